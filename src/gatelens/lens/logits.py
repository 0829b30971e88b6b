"""Which of a model's outputs are its next-token logits (docs/methods.md, "Output-level reach").

The output-level reach and the context figures read logits (B, T, V). A model returns
them in many ways; ``find_logits`` takes them only where they are logits:

- a dict or an HF ``ModelOutput`` (or any object) with a ``logits`` tensor: that one;
- a Tensor: itself; a tuple, list or dict: its floating-point tensors (nested too) shaped
  (B, T, V) against the windows and the vocabulary, whatever their position ((h, logits)
  as well as (logits, state));
- the recurrent modules' own outputs are never the logits (with H = V, (h, logits) or a
  bare h have the shape too): left out, and if more than one tensor remains, or none, no
  reach, with a note saying why;
- logits holding NaN or +inf are no distribution: no reach, with a note;
- probabilities (every entry ≥ 0, every row summing to 1: a softmax output) are turned
  into their logarithms, log-probabilities, which are logits of the same distribution
  (softmax(log p) = p), with a note; log-probabilities are logits as they are.

>>> import torch
>>> h, logits = torch.randn(2, 5, 4), torch.randn(2, 5, 7)
>>> got = find_logits((h, logits), batch=2, length=5, vocab=7)
>>> got.logits is logits, got.note
(True, None)
>>> p = torch.softmax(logits, dim=-1)
>>> got = find_logits(p, batch=2, length=5, vocab=7)
>>> bool((got.logits - p.log()).abs().max() == 0), got.note.startswith("the model returns ")
(True, True)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.readout.own_call import mark


@dataclass
class Found:
    """The logits found in an output (None: none usable), and a note for the report: why
    none, or how the output was read (probabilities turned into log-probabilities)."""

    logits: Tensor | None
    note: str | None = None


def candidates(output: Any, where: str = "", depth: int = 0) -> list[tuple[str, Tensor]]:
    """(where, tensor) of every floating-point tensor that may be the logits, in order: the
    output itself, a dict's or an object's ``logits``, else every tensor inside tuples,
    lists and dicts, nested (``((logits,), h)``) up to 4 levels. Integer tensors (ids,
    counts) are never logits."""
    if isinstance(output, Tensor):
        return [(where or "the output", output)] if output.is_floating_point() else []
    value = output.get("logits") if isinstance(output, Mapping) else getattr(
        output, "logits", None)
    if isinstance(value, Tensor):
        return candidates(value, f"{where}['logits']" if where else "its 'logits'", depth)
    if depth >= 4:
        return []
    if isinstance(output, Mapping):
        items = [(f"[{k!r}]", v) for k, v in output.items()]
    elif isinstance(output, (tuple, list)):
        items = [(f"[{i}]", v) for i, v in enumerate(output)]
    else:
        return []
    out = []
    for key, v in items:
        out += candidates(v, f"{where}{key}" if where else f"its element {key[1:-1]}"
                          if isinstance(output, (tuple, list)) else f"its {key[1:-1]}",
                          depth + 1)
    return out


def is_probabilities(x: Tensor) -> bool:
    """Every entry ≥ 0 and every row (last dim) summing to 1 within the dtype's rounding.

    >>> is_probabilities(torch.softmax(torch.randn(2, 3, 5), -1)), is_probabilities(
    ...     torch.randn(2, 3, 5)), is_probabilities(torch.log_softmax(torch.randn(2, 3, 5), -1))
    (True, False, False)
    """
    if not x.is_floating_point() or not x.numel() or x.shape[-1] < 2:
        return False
    tol = max(1e-4, 32 * torch.finfo(x.dtype).eps)  # float32 1e-4, float16 0.03
    if not bool((x >= 0).all()):
        return False
    return bool(((x.double().sum(-1) - 1).abs() <= tol).all())


def _same(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)))


def find_logits(output: Any, batch: int, length: int, vocab: int | None,
                avoid: Iterable[Tensor] = ()) -> Found:
    """The next-token logits (B, T, V) in ``output`` (see the module docstring). ``vocab``
    None: any last dim; ``avoid``: tensors that are not logits (the recurrent modules'
    outputs). An output with no tensor of that shape keeps its first tensor, so the reach's
    note names the shape it got."""
    cands = candidates(output)
    if not cands:
        return Found(None, "the model gave no floating-point tensor output to compare")
    want = (batch, length)

    def fits(t: Tensor) -> bool:
        return t.ndim == 3 and tuple(t.shape[:2]) == want and (
            vocab is None or t.shape[-1] == vocab)

    fit = [(w, t) for w, t in cands if fits(t)]
    if not fit:
        return Found(cands[0][1])  # not logits: measure's note names its shape
    avoid = list(avoid)  # a recurrent module's own output is h, never the logits
    mine = [w for w, t in fit if any(_same(t, a) for a in avoid)]
    fit = [(w, t) for w, t in fit if w not in mine]
    if not fit:
        return Found(None, f"the model's output ({mine[0]}) is a recurrent module's own "
                           "output, not logits; return the logits (alone, or under the key "
                           "'logits')")
    if len(fit) > 1:
        shape = f"({batch}, {length}, {fit[0][1].shape[-1]})"
        return Found(None, f"the model's output holds {len(fit)} tensors shaped {shape} "
                           f"({', '.join(w for w, _ in fit)}) and none is a recurrent module's "
                           "output, so gatelens cannot tell which is the logits; return the "
                           "logits alone or under the key 'logits'")
    where, logits = fit[0]
    if bool(torch.isnan(logits).any()) or bool(torch.isposinf(logits).any()):
        return Found(None, f"the model's logits ({where}) hold NaN or +inf, so its "
                           "predictions are not distributions; no output-level figure")
    if is_probabilities(logits):
        return Found(logits.log(), f"the model returns probabilities ({where}: every entry "
                                   ">= 0, every row summing to 1), not logits; the reach and "
                                   "the context figures use their logarithms "
                                   "(log-probabilities)")
    return Found(logits)


@contextlib.contextmanager
def recurrent_outputs(families: Iterable[Any]) -> Iterator[list[Tensor]]:
    """The first tensor each of the ``families``' modules returns while the block runs
    (their h, which is not the logits; a family whose module returns the model's logits,
    ``output_is_logits``, is left out), by forward hooks removed afterwards."""
    seen: list[Tensor] = []

    def hook(mod: nn.Module, args: tuple, output: Any) -> None:
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        data = getattr(first, "data", None) if not isinstance(first, Tensor) else first
        if isinstance(data, Tensor):
            seen.append(data)

    handles = [f.module.register_forward_hook(mark(hook)) for f in families
               if not getattr(f, "output_is_logits", False)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def logits_at_of(model: nn.Module, vocab: int | None
                 ) -> Callable[[Tensor, list[int]], Tensor | None] | None:
    """(ids (N, d), positions) -> the logits at those positions only (N, P, V), where the
    model can skip the others: a transformers causal LM computes its head only on the
    positions its ``logits_to_keep`` keeps. The context used reads a few positions of each
    truncated run, and a 50k-token head costs more than a few recurrent layers. None where
    the model cannot; the function returns None where its output holds no such logits."""
    try:
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes or not hasattr(model, "config"):
        return None

    def at(ids: Tensor, positions: list[int]) -> Tensor | None:
        keep = torch.tensor(positions, dtype=torch.int64, device=ids.device)
        flags = {m: m.training for m in model.modules()}
        try:
            model.eval()
            with torch.no_grad():
                out = model(ids, use_cache=False, logits_to_keep=keep)
        finally:
            for m, flag in flags.items():
                m.training = flag
        logits = getattr(out, "logits", None)
        if (not isinstance(logits, Tensor) or logits.ndim != 3
                or tuple(logits.shape[:2]) != (ids.shape[0], len(positions))
                or (vocab is not None and logits.shape[-1] != vocab)):
            return None
        return logits
    return at


def pads_to(model: nn.Module) -> int | None:
    """The length a model pads each sequence to a multiple of, where its config says so (a
    chunked scan's ``chunk_size``: transformers' Mamba-2 and its hybrids); None otherwise."""
    chunk = getattr(getattr(model, "config", None), "chunk_size", None)
    return chunk if isinstance(chunk, int) and chunk > 1 else None


def output_logits(output: Any, vocab: int | None = None) -> Tensor | None:
    """The logits of a model's output (lens/logits.py ``find_logits``): a dict's or an HF
    ModelOutput's ``logits``, else the Tensor or a tuple's tensor shaped (B, T, V) against
    ``vocab`` (None: any V), probabilities as their logarithms; None when it cannot tell.

    >>> output_logits((torch.ones(1, 2, 3), None)).shape
    torch.Size([1, 2, 3])
    >>> output_logits((torch.zeros(1, 2, 4), torch.zeros(1, 2, 3)), vocab=3).shape
    torch.Size([1, 2, 3])
    """
    first = next((t for _, t in candidates(output) if t.ndim == 3), None)
    if first is None:
        return None
    return find_logits(output, int(first.shape[0]), int(first.shape[1]), vocab).logits
