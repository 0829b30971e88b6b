"""The perturbation's exact split into forget path and return path, layer by layer.

docs/methods.md "Forget path and return path". With s the carried state, δs_t = s'_t − s_t
the perturbed run's difference and f_t the clean run's keep factor (or keep operator A_t):

    forget path  φ_t = f_t ⊙ φ_{t−1},        φ_p = δs_p
    return path  r_t = f_t ⊙ r_{t−1} + u_t,  r_p = 0,   φ_t + r_t = δs_t

with u_t what re-enters through the input side (the perturbed run's keep and write against
the clean run's). Every keep acts within its own layer, so the whole stack's split is its
layers' splits side by side on the state axis. ``Split`` computes one layer's on demand and
nothing else: the figures that pool the layers (a norm over the whole state) are sums of
the layers' squares, so no more than one layer's float64 (B, T, S_k) arrays exist at once
(at 24 layers of mamba-130m's shape the whole stack's split of one window was 1.8 GB,
with 3.6 GB more while it was formed). An element-wise keep acts on each coordinate
alone, so a layer's split is also read in blocks of coordinates (``Split.parts``): its
norms are sums over the coordinates and its residual a maximum.

>>> import torch
>>> from gatelens.readout.trace_types import Trace
>>> f = torch.full((1, 4, 2), 0.5); i = torch.ones(1, 4, 2); o = torch.ones(1, 4, 2)
>>> g = torch.zeros(1, 4, 2); g2 = g.clone(); g2[:, 1] = 1.0; g2[:, 2] = 1.0
>>> def run(g):
...     c, prev = torch.zeros(1, 4, 2), torch.zeros(1, 2)
...     for t in range(4):
...         prev = f[:, t] * prev + i[:, t] * g[:, t]; c[:, t] = prev
...     return Trace("lstm", 1, False, {f"layer0.{k}": v for k, v in
...                                     dict(i=i, f=f, g=g, o=o, c=c, h=c.tanh()).items()})
>>> part = Split.of(run(g), run(g2), position=1).layer(0)
>>> part["forget_path"][0, :, 0].tolist(), part["return_path"][0, :, 0].tolist()
([0.0, 1.0, 0.5, 0.25], [0.0, 0.0, 1.0, 0.5])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import Tensor

from gatelens.cells.names import layer_name
from gatelens.readout.trace_types import Trace

__all__ = ["Split", "add_squares", "as_split", "decompose", "keep_at", "perturbed_letters",
           "perturbed_part"]

PATHS = ("measured", "forget_path", "return_path")

#: the most bytes of one float64 (B, T, ·) array of a layer's split block (``Split.blocks``)
BLOCK_BYTES = 16 * 2**20


class Split:
    """The split of one perturbed run against its clean run, one layer at a time."""

    def __init__(self, trace: Trace, perturbed: Trace, position: int) -> None:
        self.trace, self.perturbed, self.position = trace, perturbed, position
        self.widths = [trace[f"{layer_name(k)}.{trace.state_name}"].shape[-1]
                       for k in range(trace.num_layers)]

    @classmethod
    def of(cls, trace: Trace, perturbed: Trace, position: int) -> Split | None:
        """The split, or None for a cell with no keep gate (a plain RNN)."""
        return None if trace.keep_gate is None else cls(trace, perturbed, position)

    @property
    def num_layers(self) -> int:
        return len(self.widths)

    @property
    def windows(self) -> int:
        return int(self.trace[f"layer0.{self.trace.state_name}"].shape[0])

    def blocks(self, k: int) -> list[slice]:
        """Layer k's state coordinates in blocks whose float64 (B, T, ·) arrays are at most
        ``BLOCK_BYTES`` each: every element-wise keep acts on each coordinate alone, so a
        layer's split is its blocks' side by side (a keep operator's is one block: it mixes
        a head's coordinates). At 24 Mamba-2 layers of mamba2-130m's width one layer's
        whole split held 1.8 GB more while it was formed."""
        width = self.widths[k]
        if self.trace.spec.keep_operator is not None:
            return [slice(0, width)]
        T = int(self.trace[f"layer0.{self.trace.state_name}"].shape[1])
        step = max(1, BLOCK_BYTES // (8 * self.windows * T))
        return [slice(a, min(a + step, width)) for a in range(0, width, step)]

    def parts(self, k: int) -> Iterator[dict[str, Tensor]]:
        """Layer k's split block by block (``blocks``), each ``layer(k, block)``."""
        return (self.layer(k, block) for block in self.blocks(k))

    def layer(self, k: int, block: slice | None = None) -> dict[str, Tensor]:
        """Layer k's "measured", "forget_path" and "return_path", float64 (B, T, S_k), or
        of the state coordinates ``block`` only (an element-wise keep's)."""
        tr, pt, p = self.trace, self.perturbed, self.position
        name = f"{layer_name(k)}.{tr.state_name}"
        operator = tr.spec.keep_operator is not None  # the delta rule: A_t on a head's matrix
        if block is None or operator:
            block = slice(0, self.widths[k])
        s, s2 = tr[name][..., block].double(), pt[name][..., block].double()
        measured = s2 - s
        measured[:, :p] = 0.0
        forget, ret = torch.zeros_like(measured), torch.zeros_like(measured)
        forget[:, p] = measured[:, p]
        f = None if operator else _keep_of(tr, k, block).double()  # (B, T, |block|)
        if operator or _written(tr):  # the write from the states: u_t = δs_t − A_t(δs_{t−1})
            for t in range(p + 1, s.shape[1]):
                A = _operator(tr, k, t) if operator else f[:, t].mul
                forget[:, t] = A(forget[:, t - 1])
                ret[:, t] = A(ret[:, t - 1]) + measured[:, t] - A(measured[:, t - 1])
            return {"measured": measured, "forget_path": forget, "return_path": ret}
        f2 = _keep_of(pt, k, block).double()
        entry, entry2 = _entries(tr, pt, k, f, f2, block)
        for t in range(p + 1, s.shape[1]):
            u = (f2[:, t] - f[:, t]) * s2[:, t - 1] + entry2[:, t] - entry[:, t]  # (B, S_k)
            forget[:, t] = f[:, t] * forget[:, t - 1]
            ret[:, t] = f[:, t] * ret[:, t - 1] + u
        return {"measured": measured, "forget_path": forget, "return_path": ret}

    def whole(self, windows: int | None = None) -> dict[str, Tensor]:
        """Every layer side by side, (n, T, S) float64 each, for the first ``windows``."""
        parts = [{n: v[:windows] for n, v in self.layer(k).items()}
                 for k in range(self.num_layers)]
        return {n: torch.cat([part[n] for part in parts], dim=-1) for n in PATHS}

    def nbytes(self) -> int:
        """The bytes of ``whole()`` for every window."""
        T = int(self.trace[f"layer0.{self.trace.state_name}"].shape[1])
        return len(PATHS) * self.windows * T * sum(self.widths) * 8


class _Sliced(Split):
    """A split already computed on the whole stack (``decompose``'s dict), read by layer."""

    def __init__(self, whole: dict[str, Tensor], trace: Trace, position: int) -> None:
        super().__init__(trace, trace, position)
        self._whole = whole

    def layer(self, k: int, block: slice | None = None) -> dict[str, Tensor]:
        a = sum(self.widths[:k])
        block = slice(0, self.widths[k]) if block is None else block
        return {n: v[..., a + block.start : a + block.stop] for n, v in self._whole.items()}


def as_split(split: Split | dict[str, Tensor] | None, trace: Trace, perturbed: Trace,
             position: int) -> Split | None:
    """``split`` read by layer: a ``Split`` as it is, ``decompose``'s dict sliced, None
    computed (None for a cell with no keep gate)."""
    if isinstance(split, Split):
        return split
    if isinstance(split, dict):
        return _Sliced(split, trace, position)
    return Split.of(trace, perturbed, position)


def add_squares(sums: dict[str, Tensor], key: str, v: Tensor, p: int) -> Tensor:
    """‖v_t‖² of one layer's piece v (B, T, S_k) at every lag from p, (B, T − p), added to
    ``sums[key]`` (a pooled norm is the root of its layers' sums) and returned."""
    add = v[:, p:].square().sum(dim=-1)
    sums[key] = add if key not in sums else sums[key] + add
    return add


def decompose(trace: Trace, perturbed: Trace, position: int) -> dict[str, Tensor] | None:
    """Exact split of δs into forget path and return path, float64, (B, T, S) each, every
    layer side by side (``Split.whole``).

    ``measured`` = forget_path + return_path up to float rounding of the traced values;
    all three are zero before p; at p the forget path is δs_p and the return path zero.
    None for a plain RNN, which has no keep gate.
    """
    split = Split.of(trace, perturbed, position)
    return None if split is None else split.whole()


def _keep_of(trace: Trace, k: int, block: slice) -> Tensor:
    """Layer k's keep factor of each coordinate ``block`` of its state, (B, T, |block|):
    the keep gate itself where s has one coordinate a unit, else gathered by the family's
    ``state_units`` (a head's f on its whole matrix memory, RWKV's e^{−w} on num and den)."""
    f = trace[f"{layer_name(k)}.{trace.keep_gate}"]
    units = trace.meta.get("state_units")
    return f[..., block] if units is None else f[..., units[k][block].to(f.device)]


def _written(trace: Trace) -> bool:
    """Whether the cell's write is read from its own states (an official family's: Mamba's
    Δ B u, mLSTM's i v kᵀ, RWKV's e^k (v, 1) is e_t = s_t − a_t ⊙ s_{t−1}, from the zero
    state it starts in), so that what re-enters, u_t = (f'_t − f_t) ⊙ s'_{t−1} + e'_t − e_t,
    is δs_t − f_t ⊙ δs_{t−1}: the clean keep alone, as a keep operator's."""
    return trace.spec.candidate is None and not {"i", "g"} <= set(trace.spec.signals)


def _entries(tr: Trace, pt: Trace, k: int, f: Tensor, f2: Tensor, block: slice
             ) -> tuple[Tensor, Tensor]:
    """What layer k's cell wrote to the coordinates ``block`` at each step in the clean
    and the perturbed run (a cell whose state has one coordinate a unit)."""
    sig, sig2 = tr.layer(k), pt.layer(k)
    of = lambda sig, g: sig[g][..., block].double()  # noqa: E731
    if tr.spec.candidate is None:  # LSTM-like: c' = f ⊙ c + i ⊙ g
        return of(sig, "i") * of(sig, "g"), of(sig2, "i") * of(sig2, "g")
    cand = tr.spec.candidate  # a convex mix s' = keep ⊙ s + (1 − keep) ⊙ ĉ (GRU: z, n)
    return (1 - f) * of(sig, cand), (1 - f2) * of(sig2, cand)


def perturbed_letters(trace: Trace) -> set[str]:
    """The letters of the perturbed run's trace that its measurements read: the state and
    the output, and the keep gate and write of a cell whose write is not read from its
    states (LSTM: f, i, g; GRU: z, n). An analysis keeps no other (a 24-layer Mamba's
    perturbed keep a was 302 MB a window).

    >>> from gatelens.readout.trace_types import Trace
    >>> sorted(perturbed_letters(Trace("lstm", 1, False, {})))
    ['c', 'f', 'g', 'h', 'i']
    """
    spec = trace.spec
    out = {trace.state_name, spec.output}
    if trace.keep_gate is None or spec.keep_operator is not None or _written(trace):
        return out
    return out | {trace.keep_gate, *(("i", "g") if spec.candidate is None else
                                     (spec.candidate,))}


def perturbed_part(trace: Trace) -> Trace:
    """The perturbed run's trace with only its ``perturbed_letters``."""
    keep = perturbed_letters(trace)
    return replace(trace, tensors={n: v for n, v in trace.items()
                                   if n.rsplit(".", 1)[-1] in keep})


def _operator(trace: Trace, k: int, t: int) -> Callable[[Tensor], Tensor]:
    """Layer k's keep operator of the clean run's step t on its state (B, S_k)."""
    sig = {n: v[:, t].double() for n, v in trace.layer(k).items()}
    op = trace.spec.keep_operator
    return lambda s: op(sig, s)


def keep_at(trace: Trace, t: int) -> Callable[[Tensor], Tensor]:
    """The clean run's keep operator of step t on a pooled state s (B, S), layer by layer:
    s -> A_t(s) by the cell's ``keep_operator`` (the delta rule's α S (I − β k kᵀ))."""
    ops = [_operator(trace, k, t) for k in range(trace.num_layers)]
    widths = [trace[f"{layer_name(k)}.{trace.state_name}"].shape[-1]
              for k in range(trace.num_layers)]

    def apply(s: Tensor) -> Tensor:
        parts = torch.split(s, widths, dim=-1)
        return torch.cat([op(x) for op, x in zip(ops, parts, strict=True)], dim=-1)
    return apply

