"""What an official implementation's own run is recorded with and judged by: forward hooks
that keep each submodule's calls (``Recorder``), the rule unbounded states are compared by
(``scaled_diff``), and a causal convolution's buffer along a window (``conv_buffer``).

>>> [round(d, 4) for d in scaled_diff(torch.tensor([[[2.0], [4.0]]]),
...                                   torch.tensor([[[2.0], [4.4]]]))]
[0.4, 0.0909]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["AsDtypes", "Recorder", "buffer_units", "conv_buffer", "largest_abs", "nan_max",
           "scaled_diff", "window_diff", "worst_of", "worst_of_windows"]


#: the most bytes of one (B, T, ·) block of units ``scaled_diff`` works on at once: a layer
#: of 24 Mamba-2 heads of 64 × 128 is 200 MB a window in float64, and the rule's work
#: several times that. Every block's difference is written into one buffer of this size,
#: so fresh pages are touched once a call (a new 16 MB block each time took 2.5× as long:
#: 24 ms against 8–10 for a Mamba layer's (2, 128, 24,576) states, float64 against float32)
DIFF_BYTES = 4 * 2**20


def largest_abs(x: Tensor) -> Tensor:
    """Each unit's largest |x| over the window's positions, (B, T, ·) -> (B, ·), with no |x|
    copy of the window: max |x| = max(max x, −min x), exactly (a NaN stays NaN).

    >>> largest_abs(torch.tensor([[[1.0, -3.0], [-2.0, 0.5]]])).tolist()
    [[2.0, 3.0]]
    """
    return torch.maximum(x.amax(dim=1), x.amin(dim=1).neg())


def scaled_diff(got: Tensor, ref: Tensor) -> tuple[float, float]:
    """(max |got − ref|, the same divided by each unit's largest |ref| in the window, at
    least 1): the rule ``verify_modern`` judges unbounded states by. (B, T, ·) each, taken
    a block of units at a time (``DIFF_BYTES``: each unit's figure is its own, so the
    maxima over the blocks are the whole's); a NaN anywhere is the figure."""
    if not ref.numel():
        return 0.0, 0.0
    absolute, scaled = window_diff(got, ref)
    return float(absolute.max()), float(scaled.max())


def window_diff(got: Tensor, ref: Tensor) -> tuple[Tensor, Tensor]:
    """``scaled_diff``'s two figures window by window: (B,) each, the largest over the
    window's positions and units (a NaN in a window is its figure). The float64
    re-judgement at depth reads which window float32 judged worst (readout/depth.py).

    >>> a, s = window_diff(torch.tensor([[[2.0], [4.0]], [[1.0], [1.0]]]),
    ...                    torch.tensor([[[2.0], [4.4]], [[1.0], [1.5]]]))
    >>> [round(v, 4) for v in s.tolist()], [round(v, 4) for v in a.tolist()]
    ([0.0909, 0.3333], [0.4, 0.5])
    >>> torch.equal(window_diff(torch.tensor([[2.0, 4.0], [1.0, 1.0]]),  # (B, T): one unit
    ...                         torch.tensor([[2.0, 4.4], [1.0, 1.5]]))[1], s)
    True
    """
    # in the wider of the two dtypes: two float32 values within a factor 2 of each other
    # subtract exactly (Sterbenz), so a read-out's float32 error is measured without a copy
    dtype = torch.promote_types(torch.promote_types(got.dtype, ref.dtype), torch.float32)
    got, ref = torch.broadcast_tensors(got, ref)
    if ref.ndim == 2:  # (B, T): one unit, whose scale is its largest |ref| in the window
        got, ref = got[..., None], ref[..., None]
    W = ref.shape[-1]
    step = max(1, DIFF_BYTES // max(1, ref[..., 0].numel() * dtype.itemsize))
    absolute = scaled = None
    buf = ref.new_empty((*ref.shape[:-1], min(step, W)), dtype=dtype)
    for a in range(0, W, step):
        r, g = ref[..., a : a + step], got[..., a : a + step]
        # each unit's largest |ref| over the window's positions, and its largest |got − ref|
        # (subtracted in ``dtype`` as it is read: no converted copy of either); dividing by
        # a positive number keeps the order, so the largest scaled difference is the largest
        # difference divided by its unit's scale, bit for bit, with no pass over every step
        scale = largest_abs(r)[:, None].to(dtype).clamp_(min=1.0)  # (B, 1, ·)
        if g.dtype != dtype and r.dtype != dtype:  # both narrower (half): one widened
            g = g.to(dtype)
        diff = torch.sub(g, r, out=buf[..., : r.shape[-1]])
        diff = diff.abs_().amax(dim=1, keepdim=True)  # (B, 1, ·): each unit's largest
        worst = diff.flatten(1).amax(dim=1), diff.div_(scale).flatten(1).amax(dim=1)
        # torch.maximum keeps a NaN of either side: a NaN anywhere stays the figure
        absolute = worst[0] if absolute is None else torch.maximum(absolute, worst[0])
        scaled = worst[1] if scaled is None else torch.maximum(scaled, worst[1])
    return absolute, scaled


def nan_max(*values: float) -> float:
    """The largest of ``values``, NaN where any is NaN: Python's ``max`` keeps or drops a NaN
    by its place (``max(0.0, nan)`` is 0.0), and a NaN figure must never pass a check.

    >>> nan_max(1e-7, float("nan"), 3e-7), nan_max(1e-7, 3e-7)
    (nan, 3e-07)
    """
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def worst_of(figures: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """The largest of several ``scaled_diff`` figures, each of the pair (``nan_max``).

    >>> worst_of([(1e-7, 2e-7), (float("nan"), 1e-7), (3e-7, 1e-7)])
    (nan, 2e-07)
    """
    pairs = list(figures)
    return nan_max(*(p[0] for p in pairs)), nan_max(*(p[1] for p in pairs))


def worst_of_windows(windows: list[tuple[Tensor, Tensor]], *others: tuple[float, float]
                 ) -> tuple[float, float, int | None]:
    """The largest of several figures, ``window_diff``'s by window and ``others`` (whole
    figures, ``scaled_diff``'s), and the window of the scaled one: None where it is one of
    ``others`` or not finite (no window can be named).

    >>> s = torch.tensor([0.25, 0.5], dtype=torch.float64)
    >>> worst_of_windows([(s, s), (s, s / 4)], (0.125, 0.125)), worst_of_windows([(s, s)], (0, 1.0))
    ((0.5, 0.5, 1), (0.5, 1.0, None))
    """
    absolute, scaled = windows[0]
    for a, s in windows[1:]:
        absolute, scaled = torch.maximum(absolute, a), torch.maximum(scaled, s)
    worst = worst_of([(float(absolute.max()), float(scaled.max())), *others])
    named = math.isfinite(worst[1]) and float(scaled.max()) == worst[1]
    return worst[0], worst[1], int(scaled.argmax()) if named else None


class AsDtypes(Mapping[str, Tensor]):
    """``signals`` by letter, each handed over in ``dtype_of(letter)`` when it is read and
    not before: a check that reads two of a layer's signals converts those two only.

    >>> v = AsDtypes({"s": torch.ones(2, dtype=torch.float64)}, ["s"], lambda x: torch.float32)
    >>> v["s"].dtype, list(v)
    (torch.float32, ['s'])
    """

    def __init__(self, signals: dict[str, Tensor], letters: Iterable[str],
                 dtype_of: Callable[[str], torch.dtype]) -> None:
        self.signals, self.letters, self.dtype_of = signals, list(letters), dtype_of

    def __getitem__(self, letter: str) -> Tensor:
        if letter not in self.letters:
            raise KeyError(letter)
        return self.signals[letter].to(self.dtype_of(letter))

    def __iter__(self) -> Iterator[str]:
        return iter(self.letters)

    def __len__(self) -> int:
        return len(self.letters)


class Recorder:
    """Forward hooks that keep what each of some modules received (its first argument)
    and returned (its first output), call by call, so a step-by-step run can be stacked.

    ``steps`` (name -> (module, a TorchFunctionMode class)): during each call of such a
    module a fresh mode of that class is active, so it can keep the tensors the module's
    own loop formed (forward_scan.SequentialScanStates: the states a package's sequential
    scan held); ``captured[name]`` holds one mode a call, ``taken`` hands them over."""

    def __init__(self, modules: dict[str, nn.Module],
                 steps: Mapping[str, tuple[nn.Module, Callable[[], Any]]] | None = None
                 ) -> None:
        self.modules = modules
        self.steps = dict(steps or {})
        self.inputs: dict[str, list[Tensor]] = {n: [] for n in modules}
        self.outputs: dict[str, list[Tensor]] = {n: [] for n in modules}
        self.captured: dict[str, list[Any]] = {n: [] for n in self.steps}
        self._handles: list = []

    def __enter__(self) -> Recorder:
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(self._hook(name), with_kwargs=True))
        for name, (mod, mode) in self.steps.items():
            self._handles += self._capture(name, mod, mode)
        return self

    def _capture(self, name: str, mod: nn.Module, mode: Callable[[], Any]) -> list:
        """Hooks that make a fresh ``mode`` active for each call of ``mod`` (entered just
        before its forward, left just after, also when it raised: the mode stack stays
        as it was)."""
        def enter(module: nn.Module, *_: object) -> None:
            # a module in training mode is read by a run of its own (readout/hooks.py)
            self.captured[name].append(None if module.training else mode())
            if self.captured[name][-1] is not None:
                self.captured[name][-1].__enter__()

        def leave(*_: object) -> None:
            if self.captured[name][-1] is not None:
                self.captured[name][-1].__exit__(None, None, None)

        return [mod.register_forward_pre_hook(enter),
                mod.register_forward_hook(leave, always_call=True, prepend=True)]

    def held(self, name: str) -> Any:
        """The mode of ``name``'s one call since the last ``clear``, handed over (``taken``);
        None unless it was called exactly once, in eval mode, or it has no ``steps`` entry."""
        modes = self.taken(name) if name in self.captured else []
        return modes[0] if len(modes) == 1 else None

    def taken(self, name: str) -> list[Any]:
        """The modes of ``name``'s calls since the last ``clear``, handed over (no longer
        held here: what they kept is freed with them)."""
        modes, self.captured[name] = self.captured.get(name, []), []
        return modes

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, name: str):
        def hook(mod, args, kwargs, out):
            first = args[0] if args else next(iter(kwargs.values()))
            self.inputs[name].append(first.detach().clone())
            res = out[0] if isinstance(out, (tuple, list)) else out
            self.outputs[name].append(res.detach().clone())
        return hook

    def once(self) -> bool:
        """Whether every module was called exactly once since the last ``clear``."""
        return all(len(v) == 1 for v in self.inputs.values())

    def clear(self) -> None:
        for v in (*self.inputs.values(), *self.outputs.values(), *self.captured.values()):
            v.clear()

    def stacked(self, name: str, outputs: bool = False) -> Tensor:
        """The calls' tensors of ``name`` joined along time, (B, T, ·)."""
        seq = (self.outputs if outputs else self.inputs)[name]
        return seq[0] if len(seq) == 1 else torch.cat(seq, dim=1)

    def blocks(self, layers: int) -> dict[str, list[Tensor]]:
        """Each layer's block and mixer as recorded under ``block{k}`` and ``mixer{k}``: the
        trajectory's "x" (block inputs), "u" (mixer inputs), "y" (mixer outputs) and "xo"
        (block outputs), one (B, T, ·) tensor a layer."""
        return {key: [self.stacked(f"{name}{k}", outputs) for k in range(layers)]
                for key, name, outputs in (("x", "block", False), ("u", "mixer", False),
                                           ("y", "mixer", True), ("xo", "block", True))}


def conv_buffer(seq: Tensor, width: int) -> Tensor:
    """The last ``width`` − 1 rows of a causal convolution's input after each step, zeros
    before the start: (B, T, F) -> (B, T, (width − 1)·F), oldest first."""
    B, T, F = seq.shape
    pad = torch.cat([seq.new_zeros(B, width - 1, F), seq], dim=1)  # (B, T + w − 1, F)
    return torch.cat([pad[:, j + 1 : j + 1 + T] for j in range(width - 1)], dim=-1)


def buffer_units(width: int, channels: int) -> Tensor:
    """``part_units`` of a convolution buffer: no unit (−1)."""
    return torch.full(((width - 1) * channels,), -1, dtype=torch.int64)
