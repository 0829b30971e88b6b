"""Check a trace against the module's own output, every layer and direction.

PyTorch returns only the last layer's sequence. To check layer k < L - 1 over its full
sequence, ``verify`` builds a fresh module of the same class with k + 1 layers, gives it
copies of the first k + 1 layers' weights and runs it; the user's module is only read.
c is compared on each layer's final c_n (PyTorch exposes no other c).

Tolerance. h lies in (−1, 1), so an absolute 1e-5 is a fair float32 bound. c is not
bounded: a trained LSTM whose forget gates sit near 1 carries |c| of 20 and more, where one
float32 rounding step is ~2e-6 and two correct float32 runs (oneDNN's fused kernel and
ATen's step loop) drift apart by ~1e-5 over 128 steps. So c passes when
|c_hand − c_torch| / max(1, |c_torch|) ≤ 1e-5: the absolute test for |c| ≤ 1, a relative
one above. ``max_abs_diff_c`` is still reported as METHODS.md defines it.

>>> import torch
>>> res = verify(torch.nn.LSTM(3, 4, num_layers=2), torch.randn(5, 2, 3))
>>> res.passed, len(res.layers)
(True, 2)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.reference import copy_layers, faithful_matmul, run_module
from gatelens.trace import State, check_module
from gatelens.trace import trace as trace_fn
from gatelens.trace_types import Trace

#: Largest max |hand − torch| that passes (METHODS.md: ~1e-7 expected on CPU float32).
VERIFY_TOL = 1e-5


def passes(diff_h: float, diff_c: float | None, tol: float = VERIFY_TOL) -> bool:
    """The verification rule: |Δh| ≤ tol, and c's difference (scaled by max(1, |c|), see the
    module docstring; None without a cell state) ≤ tol.

    >>> passes(1e-7, None), passes(1e-7, 2e-5), passes(2e-5, None)
    (True, False, False)
    """
    return diff_h <= tol and (diff_c is None or diff_c <= tol)


@dataclass(frozen=True)
class LayerDiff:
    """Max absolute differences of one layer and direction."""

    layer: int
    reverse: bool
    max_abs_diff_h: float  # over every window, position and unit, and h_n
    max_abs_diff_c: float | None  # final c_n (LSTM only)
    max_scaled_diff_c: float | None = None  # max |Δc| / max(1, |c_torch|) (LSTM only)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of ``verify``: per layer and direction, and overall."""

    cell: str
    layers: list[LayerDiff]
    max_abs_diff_h: float
    max_abs_diff_c: float | None
    tol: float = VERIFY_TOL
    meta: dict = field(default_factory=dict)
    max_scaled_diff_c: float | None = None  # max |Δc| / max(1, |c_torch|)

    @property
    def passed(self) -> bool:
        """h within ``tol``; c within ``tol`` scaled by max(1, |c|) (module docstring)."""
        return passes(self.max_abs_diff_h, self.max_scaled_diff_c, self.tol)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (``passed`` included)."""
        return {**asdict(self), "passed": self.passed}

    def to_report(self) -> dict:
        """report.json's "verification": the maxima, the tolerance and the verdict.

        >>> VerifyResult("gru", [], 6.85e-07, None).to_report()["passed"]
        True
        """
        return {"max_abs_diff_h": self.max_abs_diff_h, "max_abs_diff_c": self.max_abs_diff_c,
                "max_scaled_diff_c": self.max_scaled_diff_c, "tolerance": self.tol,
                "passed": self.passed}


def _slice_state(state: State, rows: int) -> State:
    if state is None:
        return None
    if isinstance(state, tuple):
        return tuple(s[:rows] for s in state)
    return state[:rows]


def verify(module: nn.Module, inputs: Tensor | PackedSequence, state: State = None,
           trace: Trace | None = None, tol: float = VERIFY_TOL) -> VerifyResult:
    """Max |h_hand − h_torch| (and c) of ``trace`` (computed if None) per layer and direction.

    >>> import torch
    >>> gru = torch.nn.GRU(2, 3, batch_first=True)
    >>> r = verify(gru, torch.randn(2, 4, 2))
    >>> r.max_abs_diff_c is None, r.to_dict()["passed"]
    (True, True)
    """
    cell = check_module(module)
    tr = trace_fn(module, inputs, state) if trace is None else trace
    L, D = module.num_layers, 2 if module.bidirectional else 1
    layers = []
    with faithful_matmul(module.weight_ih_l0.device):
        for k in range(L):
            ref = module if k == L - 1 else copy_layers(module, 0, k + 1, module.batch_first)
            out, h_n, c_n = run_module(ref, inputs, _slice_state(state, (k + 1) * D))
            H_out = out.shape[-1] // D
            for d in range(D):
                name = f"layer{k}{'.reverse' if d else ''}"
                h = tr[name + ".h"]  # (B, T, H_out)
                ref_h = out[..., d * H_out : (d + 1) * H_out]  # (B, T', H_out), T' <= T if packed
                diff_h = _maxdiff(h[:, : ref_h.shape[1]], ref_h)
                diff_h = max(diff_h, _maxdiff(tr.h_n[k * D + d], h_n[k * D + d]))
                diff_c = scaled_c = None
                if c_n is not None:
                    diff_c = _maxdiff(tr.c_n[k * D + d], c_n[k * D + d])
                    scaled_c = _maxdiff(tr.c_n[k * D + d], c_n[k * D + d], scaled=True)
                layers.append(LayerDiff(k, bool(d), diff_h, diff_c, scaled_c))
    max_c = scaled = None
    if cell == "lstm":
        max_c = max(x.max_abs_diff_c for x in layers)
        scaled = max(x.max_scaled_diff_c for x in layers)
    max_h = max(x.max_abs_diff_h for x in layers)
    return VerifyResult(cell=cell, layers=layers, max_abs_diff_h=max_h, max_abs_diff_c=max_c,
                        tol=tol, meta={"dtype": str(module.weight_ih_l0.dtype)},
                        max_scaled_diff_c=scaled)


def _maxdiff(a: Tensor, b: Tensor, scaled: bool = False) -> float:
    """max |a − b|, or with ``scaled`` max |a − b| / max(1, |b|)."""
    if not a.numel():
        return 0.0
    diff = (a.double() - b.double()).abs()
    if scaled:
        diff = diff / b.double().abs().clamp(min=1.0)
    return float(diff.max())
