"""The whole model run with edits inside its recurrent modules (``Lens.run``).

The model runs as usual (eval mode, no gradients); each edited module gets a forward
hook that hands the module's call to its family (``Family.intervene``): the module's own
kernel up to the first edited step, the family's step with the edit inside it, and the
edited output returned in the module's place, so every later layer, the head and a
decoder behind an encoder see the edited run. A module called one step at a time (a cell
in a loop, a decoder called per step) is edited at the calls whose index is an edited
position; the state it hands back carries the edit into the next call.

The trace is ``open_cells``'s of the edited run (every module downstream reads what it
really received), with each edited module's signals the edited trajectory's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gatelens.cells.names import layer_name
from gatelens.cells.numerics import faithful_matmul, quiet_onednn
from gatelens.errors import GatelensError
from gatelens.families.base import Family, Readout
from gatelens.families.official_edit import ENTRY, clean_entry, entry_cut
from gatelens.interventions.edits import Edit
from gatelens.interventions.resolve import Resolved, plan_of, resolve
from gatelens.readout.hooks import (
    CellCache,
    family_calls,
    in_family_call,
    open_cells,
    read_elsewhere,
)
from gatelens.readout.stitch import is_step_call
from gatelens.readout.trace import assemble

if TYPE_CHECKING:
    from gatelens.lens.lens import Lens

__all__ = ["RunResult", "run_edits"]


@dataclass
class RunResult:
    """What ``Lens.run`` returns: ``output``, what the model's forward returned on the
    edited run; ``trace``, every recurrent module's signals on it, keyed like
    ``open_cells`` (``"lstm.layer0.c"`` -> (B, T, H)); ``edits``, the edits as given."""

    output: Any
    trace: CellCache | None
    edits: list[Edit] = field(default_factory=list)


def _names(fam: Family) -> list[str]:
    """The names an edit of ``fam`` may take: its trace names, and each layer's write
    ``layerK.entry`` where its step takes one (families/official_edit.py)."""
    if entry_cut(fam) is None:
        return fam.names()
    return fam.names() + [f"{layer_name(k)}.{ENTRY}" for k in range(fam.num_layers)]


def _keys(lens: Lens) -> dict[str, tuple[str, str]]:
    """Every key an edit may name -> (module path, trace name), in the model's order."""
    return {(f"{path}.{n}" if path else n): (path, n)
            for path, fam in lens.families.items() for n in _names(fam)}


def _forward(lens: Lens, ids: Tensor, grad: bool = False) -> Any:
    """The model on ids in eval mode, every training flag restored; no gradients unless
    ``grad`` (then cuDNN is off: its RNN backward refuses eval mode)."""
    flags = {m: m.training for m in lens.model.modules()}
    try:
        lens.model.eval()
        with torch.set_grad_enabled(grad), quiet_onednn(), \
                torch.backends.cudnn.flags(enabled=not grad):
            return lens._forward(lens.model, ids)
    finally:
        for m, flag in flags.items():
            m.training = flag


def clean_trace(lens: Lens, ids: Tensor, entries: bool = False) -> dict[str, Tensor]:
    """The unedited run's trace on ids, flat (``open_cells``'s keys); ``entries``: with
    each layer's write ``entry`` where the family has one (from that run's own signals)."""
    with open_cells(lens.model) as cache:
        _forward(lens, ids)
    out = {k: cache[k] for k in cache}
    for path, fam in lens.families.items() if entries else ():
        traces = cache.traces.get(path) or []
        if entry_cut(fam) is None or len(traces) != 1:
            continue
        for k in range(fam.num_layers):
            name = f"{layer_name(k)}.{ENTRY}"
            out[f"{path}.{name}" if path else name] = clean_entry(fam, traces[0], k)
    return out


@dataclass
class _Edited:
    """What one edited module's hook did: per edited call, (offset, call, signals)."""

    fam: Family
    path: str
    whole: int = 0
    steps: int = 0
    done: list = field(default_factory=list)


def _hook(state: _Edited, resolved: list[Resolved], T: int, grad: bool = False,
          signals: bool = True, start: Mapping[str, Tensor] | None = None):
    fam, name = state.fam, state.path or "the model"

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if in_family_call():  # a family running the module itself (its reference, its read)
            return None
        inputs, given = fam.split_call(args, kwargs)
        if is_step_call(fam, inputs):
            offset, length = state.steps, T
            state.steps += 1
        else:
            if state.whole:
                raise GatelensError(f"{name} ran more than once in one forward; an edit names "
                                    "one call of a module")
            state.whole += 1
            offset, length = 0, None
        try:
            call = fam.check(inputs, given)
        except (TypeError, ValueError) as e:
            raise GatelensError(f"{name}: {e}") from None
        plan = plan_of(resolved, state.path, length or call.length, name, grad, signals)
        at = [t - offset for layer in plan.layers() for t in plan.positions(layer)
              if offset <= t < offset + call.length]
        if not at:
            return None
        whole = length is None and signals  # one call on the whole window, traced: read
        if length is None:  # once, by the family's edited run stretch by stretch, or by
            plan.start = start  # open_cells unedited before the first edit (_edited_trace)
            plan.known = whole and not fam.edit_reads_whole
        with faithful_matmul(call.inputs.device), family_calls():
            out, sig = fam.intervene(call, plan, output, offset)
        if whole and fam.edit_reads_whole:
            read_elsewhere(module)
        state.done.append((offset, call, sig))
        return out

    return hook


class _instead:
    """``module.forward`` replaced, until ``remove()``, by ``hook(module, args, kwargs,
    None)``: an edited call runs the family's edited call alone (its prefix from the
    module's kernel, not spliced from its output); a call with no edit runs as it was."""

    def __init__(self, module: nn.Module, hook) -> None:
        self.module, self.old = module, module.__dict__.get("forward")
        own = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = hook(module, args, kwargs, None)
            return own(*args, **kwargs) if out is None else out

        module.forward = forward

    def remove(self) -> None:
        if self.old is None:
            del self.module.forward
        else:
            self.module.forward = self.old


def _given(cache: CellCache | None, path: str) -> dict[str, Tensor] | None:
    """The unedited run's signals of the module at ``path`` (one call on the whole window;
    else None: it runs its prefix itself)."""
    traces = [] if cache is None else cache.traces.get(path) or []
    if len(traces) != 1 or "first_call" in traces[0].meta:
        return None
    return dict(traces[0].tensors)


def _edited_trace(cache: CellCache, state: _Edited) -> None:
    """Each edited module's entries of ``cache`` made the edited trajectory's."""
    fam, path = state.fam, state.path
    cache.max_abs_diff.pop(path, None)  # it compared a read-out with the edited output
    traces = cache.traces.get(path, [])
    for offset, call, sig in state.done:
        if not state.steps:  # one call on the whole sequence; a family that gave only the
            own, T = (traces or [None])[0], call.length  # steps from its first edit on (plan.
            merged = {n: v if v.shape[1] == T else torch.cat(  # known) has open_cells's
                [own[n][:, : T - v.shape[1]].to(v.dtype), v], dim=1) for n, v in sig.items()}
            units = None if own is None else own.meta.get("state_units")  # each state
            meta = {} if units is None else {"state_units": units}  # coordinate's unit kept
            cache.traces[path] = [assemble(fam, call, Readout(merged, meta=meta), edited=True)]
            continue
        for n, tr in enumerate(traces):  # the stitched trajectory holding this call
            first = int(tr.meta.get("first_call", 0))
            if first <= offset < first + next(iter(tr.values())).shape[1]:
                tensors = dict(tr.tensors)
                for s, v in sig.items():
                    t = tensors[s].clone()
                    t[:, offset - first] = v[:, 0]
                    tensors[s] = t
                traces[n] = replace(tr, tensors=tensors, meta={**tr.meta, "edited": True})


def run_edits(lens: Lens, ids: Tensor, edits: Sequence[Edit], *, trace: bool = True,
              grad: bool = False, start: CellCache | None = None) -> RunResult:
    """``lens.model`` on ``ids`` (B, T) int64 with ``edits`` (see ``Lens.run``).
    ``trace=False``: no read-out of the edited run (``RunResult.trace`` is None; what a
    patching sweep, which reads only the output, runs); ``grad``: autograd on, through the
    edited steps (a tensor value that requires grad gets its gradient); ``start``: the
    trace of the unedited run on these ids, from which a module called once on the whole
    window may start at its first edit (its state and output before it) instead of
    running its prefix (a sweep's many runs on one input)."""
    if not isinstance(ids, Tensor):
        raise GatelensError(f"Lens.run takes ids (B, T) int64; got {type(ids).__name__}")
    ids = lens.windows(ids, 1, int(ids.shape[-1]) if ids.ndim else 1)[0]
    if isinstance(edits, (Edit, str)) or not isinstance(edits, Sequence):
        raise GatelensError("edits must be a list of gatelens.Set, Add, Scale, Zero, Mean or "
                            f"Patch; got {type(edits).__name__}")
    entries = any(isinstance(e, Edit) and str(e.name).endswith(f".{ENTRY}") for e in edits)
    resolved = resolve(edits, _keys(lens), lambda x: clean_trace(lens, x, entries), ids)
    states = {p: _Edited(lens.families[p], p) for p in dict.fromkeys(r.path for r in resolved)}
    T = int(ids.shape[1])
    if trace:  # a forward hook: the module's own output is spliced in before the first edit
        handles = [lens.families[p].module.register_forward_hook(
            _hook(st, resolved, T, grad), with_kwargs=True) for p, st in states.items()]
    else:  # the output alone: an edited call does not run the module's own forward first
        handles = [_instead(lens.families[p].module, _hook(st, resolved, T, grad, False,
                                                           _given(start, p)))
                   for p, st in states.items()]
    cache = None
    try:  # these hooks run before open_cells's, so it sees what each edited call returned
        if trace:
            with open_cells(lens.model) as cache:
                output = _forward(lens, ids, grad)
        else:
            output = _forward(lens, ids, grad)
    finally:
        for h in handles:
            h.remove()
    if cache is not None:
        for st in states.values():
            _edited_trace(cache, st)
    for r in resolved:
        missing = sorted(r.expected - r.applied)
        if missing:
            raise GatelensError(f"{r.edit!r}: {r.path or 'the model'} never ran position "
                                f"{missing[0]} in this forward (it ran "
                                f"{states[r.path].steps or 'no step-by-step'} calls)")
    return RunResult(output, cache, list(edits))
