"""What Lens's forward hooks capture, made into what ``measure`` reads: ``capturer`` hooks
the modules of one forward, ``received`` turns each module's calls into its input and
initial state (a packed batch of equal lengths unpacked, calls of one step stitched into
one trajectory), and the small rules Lens applies to its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from gatelens.errors import GatelensError
from gatelens.families.base import Family
from gatelens.lens.logits import find_logits, logits_at_of, pads_to, recurrent_outputs
from gatelens.readout.hooks import in_family_call
from gatelens.readout.own_call import mark, refuse_global_hooks
from gatelens.readout.stitch import Stitcher, is_step_call

if TYPE_CHECKING:
    from gatelens.analysis.measure import Captured
    from gatelens.lens.lens import Lens


def unpack_equal(packed: PackedSequence, length: int, batch_first: bool = True) -> Tensor:
    """A packed batch whose sequences all have ``length`` steps, as a padded tensor in the
    caller's order ((B, T, F) batch first, else (T, B, F)).

    A recurrent module fed an equal-length packed batch computes the same as fed this
    tensor (no step is padding), so the measurements, defined on equal-length windows,
    apply unchanged. Unequal lengths raise GatelensError.

    >>> import torch
    >>> from torch.nn.utils.rnn import pack_padded_sequence
    >>> x = torch.randn(3, 5, 2)
    >>> p = pack_padded_sequence(x, torch.tensor([5, 5, 5]), batch_first=True,
    ...                          enforce_sorted=False)
    >>> torch.equal(unpack_equal(p, 5), x)
    True
    """
    # pad_packed_sequence restores the caller's order through packed.unsorted_indices
    x, lengths = pad_packed_sequence(packed, batch_first=True)  # (B, T, F), caller's order
    if bool((lengths != length).any()):
        raise GatelensError(
            f"a packed batch with lengths {int(lengths.min())}..{int(lengths.max())} cannot be "
            f"measured: the measurements need every sequence {length} steps long")
    return x if batch_first else x.transpose(0, 1)


def one_trajectory(steps: Stitcher, calls: list, name: str, length: int) -> Any:
    """The one trajectory a forward's calls of one step form (readout/stitch.py); a forward
    with calls of more than one step among them, whose calls form several trajectories, or
    whose trajectory is not as long as the windows, is a one-line GatelensError saying why."""
    if steps.calls != len(calls):
        raise GatelensError(
            f"{name} ran {len(calls)} times in one forward, {len(calls) - steps.calls} of them "
            "on more than one step; Lens stitches calls of one step each (the state handed "
            "back) or measures one call on the whole sequence")
    recs = steps.result()
    if len(recs) != 1:
        raise GatelensError(
            f"{name}: its {len(calls)} calls in one forward form {len(recs)} trajectories "
            f"(the second starts because {recs[1].why}); the measurements need one "
            "trajectory per forward")
    if recs[0].length != length:
        raise GatelensError(
            f"{name}: its stitched trajectory has {recs[0].length} steps but the windows "
            f"{length}; the measurements read the trajectory by window position")
    return recs[0]


def received(fam: Family, calls: list, steps: Stitcher, name: str,
             length: int) -> tuple[Any, Any]:
    """(inputs, initial state) a module received in one forward, from its hook's ``calls``
    ((args, kwargs) split by its family) and ``steps`` (the calls of one step): one call on
    the whole sequence (a packed batch unpacked), or calls of one step stitched into one
    trajectory (then the trajectory and None); a module called more than once otherwise is
    a one-line GatelensError."""
    if steps.calls and (len(calls) > 1 or fam.stepped):
        return one_trajectory(steps, calls, name, length), None
    if len(calls) != 1:
        raise GatelensError(
            f"{name} ran {len(calls)} times in one forward; Lens measures modules that read "
            "the whole sequence in one call, or one step a call with the state handed back")
    inputs, hx = calls[0]
    if isinstance(inputs, PackedSequence):
        inputs = unpack_equal(inputs, length, fam.module.batch_first)
    return inputs, hx


def rows(model: nn.Module) -> int | None:
    """How many ids a model reads: its ``vocab_size``, else its first embedding's rows."""
    size = getattr(model, "vocab_size", None)
    if isinstance(size, int):
        return size
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if emb is None else emb.num_embeddings


def names_a_file(text: str) -> bool:
    """Whether a str passed as text names an existing file (then it is read as one)."""
    if "\n" in text or len(text) > 4096:
        return False
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False


def capturer(lens: Lens, model: nn.Module, fams: dict[str, Family]) -> Any:
    """ids (B, T) -> {path: what that module received} from one forward of ``model`` (the
    model ``lens`` opened, or its run's untrained one), by ``received``'s rules for each,
    with ``logit_notes``, ``logits_at`` and ``pad_to`` as attributes (what ``Lens.measure``
    and the context used read)."""
    from gatelens.analysis.measure import Captured

    def run(ids: Tensor) -> dict[str, Captured]:
        calls: dict[str, list[tuple[Any, Any]]] = {path: [] for path in fams}
        steps = {path: Stitcher(fam) for path, fam in fams.items()}
        for path, fam in fams.items():  # before any hook is placed
            refuse_global_hooks(f"Lens: {path or type(model).__name__}",
                                type(fam.module).__name__)
        handles = [fam.module.register_forward_hook(
            mark(hook_of(fam, calls[path], steps[path])), with_kwargs=True)
            for path, fam in fams.items()]
        flags = {m: m.training for m in model.modules()}
        try:
            model.eval()
            with torch.no_grad(), recurrent_outputs(lens.families.values()) as seen:
                out = lens._forward(model, ids)
        finally:
            for handle in handles:
                handle.remove()
            for m, flag in flags.items():
                m.training = flag
        got = {path: received(fam, calls[path], steps[path], path or type(model).__name__,
                              int(ids.shape[1])) for path, fam in fams.items()}
        logits = logits_of(out, seen, ids)
        return {path: Captured(*parts, logits) for path, parts in got.items()}

    def hook_of(fam: Family, calls: list, steps: Stitcher) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if in_family_call():  # an edited call's family running its module itself
                return
            calls.append(fam.split_call(args, kwargs))
            if is_step_call(fam, calls[-1][0]):
                steps.add(*calls[-1], output)
        return hook

    def logits_of(out: Any, seen: list[Tensor], ids: Tensor) -> Tensor | None:
        found = find_logits(out, int(ids.shape[0]), int(ids.shape[1]), lens._vocab_size(),
                            seen)
        if found.note is not None and found.note not in run.logit_notes:
            run.logit_notes.append(found.note)
        return found.logits

    run.logit_notes = []  # type: ignore[attr-defined]  # read by Lens.measure
    # what the context used's truncated runs need: a few positions' logits, and how
    # long the model pads a short run
    run.logits_at = None if lens.encode is not None else logits_at_of(  # type: ignore[attr-defined]
        model, lens._vocab_size())
    run.pad_to = pads_to(model)  # type: ignore[attr-defined]
    return run
