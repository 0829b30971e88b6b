"""Verification: is the read-out PyTorch's own computation? (docs/methods.md)

Two figures, always together:

- **one-step error** (pass/fail): every step of the hand cell is fed PyTorch's own state
  at t − 1 (h, and the LSTM's c) and compared with PyTorch's state at t (anchored.py).
  ~1e-7 in float32 on the CPU whatever the model; above 1e-5 the read-out is wrong.
- **free-running divergence** (a property of the model, never a failure by itself):
  max |h_hand − h_torch| when the hand cell runs from the initial state on its own
  outputs. On a contracting model it stays near the one-step error; on a chaotic one any
  two correct implementations part like e^{λt}, and the figure is large.

h lies in (−1, 1) and is judged absolutely; c is unbounded and is judged by
|Δc| / max(1, |c|) (absolute below 1, relative above); the absolute figure is reported too.
The modern cells' h (minGRU and minLSTM: a mix of linear candidates) and their blocks'
output y are unbounded like c; they are judged scaled by the unit's largest |value| in the
window (at least 1), which on h within (−1, 1) is the absolute rule (``verify_modern``).
A trace handed to ``verify`` is checked against the module's own output as well: a trace
must describe the trajectory the module took.

>>> import torch
>>> res = verify(torch.nn.LSTM(3, 4, num_layers=2), torch.randn(5, 2, 3))
>>> res.passed, len(res.layers)
(True, 2)
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.families.reference import copy_layers, faithful_matmul, run_module
from gatelens.readout.trace import State, check_module
from gatelens.readout.trace import trace as trace_fn
from gatelens.readout.trace_types import Trace

#: Largest max |hand − torch| that passes (docs/methods.md: ~1e-7 expected on CPU float32).
VERIFY_TOL = 1e-5


def passes(diff_h: float, diff_c: float | None, tol: float = VERIFY_TOL) -> bool:
    """The verification rule: h's difference ≤ tol (absolute, or scaled by the unit's
    largest |h| for the modern cells), and c's difference (scaled by max(1, |c|), see the
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
    max_scaled_diff_h: float | None = None  # modern cells: h and y, verify_modern's scale


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of ``verify``: the one-step error (the verdict) and the free-running
    divergence, per layer and direction and overall."""

    cell: str
    layers: list[LayerDiff]  # one-step error per layer (free-running for packed input)
    one_step_max_abs_diff_h: float | None  # None: packed input (not defined there)
    one_step_max_abs_diff_c: float | None
    one_step_max_scaled_diff_c: float | None
    free_running_max_abs_diff_h: float
    free_running_layers: list[LayerDiff] = field(default_factory=list)
    trace_max_abs_diff_h: float | None = None  # a given trace against the module's h
    trace_max_scaled_diff_c: float | None = None
    tol: float = VERIFY_TOL
    meta: dict = field(default_factory=dict)
    #: Modern cells only (h and y unbounded): the one-step error scaled by each unit's
    #: largest |value| in the window, at least 1 (verify_modern); what h is judged by there.
    one_step_max_scaled_diff_h: float | None = None
    trace_max_scaled_diff_h: float | None = None  # a given trace, the same rule

    @property
    def judged_diff_h(self) -> float:
        """What h is judged by: the scaled figure where h is unbounded, else absolute."""
        if self.one_step_max_scaled_diff_h is not None:
            return self.one_step_max_scaled_diff_h
        return self.max_abs_diff_h

    @property
    def max_abs_diff_h(self) -> float:
        """The read-out's error in h: the one-step figure (free-running for packed input)."""
        if self.one_step_max_abs_diff_h is None:
            return self.free_running_max_abs_diff_h
        return self.one_step_max_abs_diff_h

    @property
    def max_abs_diff_c(self) -> float | None:
        return self.one_step_max_abs_diff_c

    @property
    def max_scaled_diff_c(self) -> float | None:
        return self.one_step_max_scaled_diff_c

    @property
    def passed(self) -> bool:
        """The one-step error within ``tol`` (h absolutely, or on its scale for the modern
        cells; c scaled by max(1, |c|)), and a given trace on the module's trajectory by the
        same rule."""
        ok = passes(self.judged_diff_h, self.max_scaled_diff_c, self.tol)
        if self.trace_max_abs_diff_h is not None:
            ok = ok and passes(self._trace_h, self.trace_max_scaled_diff_c, self.tol)
        return ok

    @property
    def _trace_h(self) -> float:
        """A given trace's h difference as judged (modern cells: the scaled figure)."""
        if self.trace_max_scaled_diff_h is not None:
            return self.trace_max_scaled_diff_h
        return self.trace_max_abs_diff_h

    @property
    def chaotic(self) -> bool:
        """The free-running re-run parted from PyTorch while each step is right."""
        return self.free_running_max_abs_diff_h > self.tol

    def explain(self) -> str:
        """What the two figures say, in words.

        >>> text = VerifyResult("gru", [], 1e-7, None, None, 1.9).explain()
        >>> "(passed)" in text and "chaotic" in text
        True
        """
        if self.one_step_max_abs_diff_h is None:
            verdict = (f"free-running difference {self.max_abs_diff_h:.3g} "
                       f"{'<=' if self.passed else '>'} {self.tol:g} (packed input: the "
                       f"one-step check is not defined)")
            return verdict + (" (passed)." if self.passed else " (FAILED).")
        if self.one_step_max_scaled_diff_h is not None:
            return self._explain_modern()
        c = "" if self.max_scaled_diff_c is None else (
            f", c {self.max_scaled_diff_c:.3g} scaled by max(1, |c|)")
        ok = self.passes_one_step
        out = (f"one-step error {self.max_abs_diff_h:.3g}{c} {'<=' if ok else '>'} {self.tol:g}: "
               + ("each step is PyTorch's computation (passed)." if ok else
                  "the read-out does not compute PyTorch's cell (FAILED)."))
        fr = self.free_running_max_abs_diff_h
        if self.chaotic:
            out += (f" Free-running divergence {fr:.3g}: the model is chaotic on this text, so "
                    "two correct implementations part after a few dozen steps; this is the "
                    "model's property, not an error, and the anchored read-out follows the "
                    "module's own trajectory.")
        else:
            out += (f" Free-running divergence {fr:.3g}: the step-by-step re-run stays on the "
                    "module's trajectory (contracting on this text).")
        if self.trace_max_abs_diff_h is not None and not passes(
                self._trace_h, self.trace_max_scaled_diff_c, self.tol):
            out += (f" The trace given differs from the module's own states by "
                    f"{self.trace_max_abs_diff_h:.3g}: it is not the module's trajectory (FAILED).")
        return out

    def _explain_modern(self) -> str:
        """explain() for gatelens's own cells, whose reference is their parallel form.

        >>> r = VerifyResult("mingru", [], 7e-4, None, None, 2e-3,
        ...                  one_step_max_scaled_diff_h=3e-7)
        >>> r.explain().startswith("one-step error 3e-07 (h and y scaled")
        True
        """
        ok = self.passes_one_step
        out = (f"one-step error {self.one_step_max_scaled_diff_h:.3g} (h and y scaled by each "
               f"unit's largest |value| in the window, as they are unbounded; absolute "
               f"{self.max_abs_diff_h:.3g}) {'<=' if ok else '>'} {self.tol:g}: "
               + ("each layer's step computes the cell's parallel form (passed)." if ok else
                  "the step does not compute the cell's parallel form (FAILED)."))
        out += (f" Free-running difference {self.free_running_max_abs_diff_h:.3g} (absolute) "
                "between the whole sequential stack and the parallel form: rounding carried up "
                "through the layers, not an error by itself.")
        if self.trace_max_abs_diff_h is not None:
            ok = passes(self._trace_h, None, self.tol)
            out += (f" The trace given differs from the trajectory of the module's forward by "
                    f"{self._trace_h:.3g} scaled" + (" (passed)." if ok else
                                                     ": it is not the module's trajectory "
                                                     "(FAILED)."))
        return out

    @property
    def passes_one_step(self) -> bool:
        return passes(self.judged_diff_h, self.max_scaled_diff_c, self.tol)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (``passed`` included)."""
        return {**asdict(self), "passed": self.passed}

    def to_report(self) -> dict:
        """report.json's "verification" (version 2).

        >>> sorted(VerifyResult("gru", [], 6.85e-07, None, None, 1e-6).to_report())[:2]
        ['free_running_max_abs_diff_h', 'one_step_max_abs_diff_c']
        """
        return {"one_step_max_abs_diff_h": self.one_step_max_abs_diff_h,
                "one_step_max_abs_diff_c": self.one_step_max_abs_diff_c,
                "one_step_max_scaled_diff_c": self.one_step_max_scaled_diff_c,
                "one_step_max_scaled_diff_h": self.one_step_max_scaled_diff_h,
                "free_running_max_abs_diff_h": self.free_running_max_abs_diff_h,
                "tolerance": self.tol, "passed": self.passed}


def _slice_state(state: State, rows: int) -> State:
    if state is None:
        return None
    if isinstance(state, tuple):
        return tuple(s[:rows] for s in state)
    return state[:rows]


def reference(module: nn.RNNBase, inputs: Tensor | PackedSequence,
              state: State) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """PyTorch's own (output (B, T', D*H_out), h_n, c_n) of the layers up to each layer k:
    the module itself for the top layer, a fresh copy of layers 0 … k below it."""
    L, D = module.num_layers, 2 if module.bidirectional else 1
    with faithful_matmul(module.weight_ih_l0.device):
        return [run_module(module if k == L - 1 else copy_layers(module, 0, k + 1,
                                                                 module.batch_first),
                           inputs, _slice_state(state, (k + 1) * D)) for k in range(L)]


def trace_diff(module: nn.RNNBase, refs: list[tuple[Tensor, Tensor, Tensor | None]],
               tr: Trace) -> list[LayerDiff]:
    """Max |trace − PyTorch| of h over every step (and h_n, c_n) per layer and direction,
    against ``reference``'s outputs."""
    D = 2 if module.bidirectional else 1
    layers = []
    for k, (out, h_n, c_n) in enumerate(refs):
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
    return layers


def _batch_first(module: nn.RNNBase, inputs: Tensor, state: State) -> tuple[Tensor, State]:
    """Module-layout input and state as anchored.py takes them: (B, T, F), batched."""
    if inputs.ndim == 2:  # unbatched (T, F): a batch of one
        st = None if state is None else (tuple(s.unsqueeze(1) for s in state)
                                         if isinstance(state, tuple) else state.unsqueeze(1))
        return inputs.unsqueeze(0), st
    return (inputs if module.batch_first else inputs.transpose(0, 1)), state


def verify(module: nn.Module, inputs: Tensor | PackedSequence, state: State = None,
           trace: Trace | None = None, tol: float = VERIFY_TOL) -> VerifyResult:
    """The one-step error and the free-running divergence of ``module`` on ``inputs`` (what
    the module takes); with ``trace``, also that trace against the module's own states.

    >>> import torch
    >>> gru = torch.nn.GRU(2, 3, batch_first=True)
    >>> r = verify(gru, torch.randn(2, 4, 2))
    >>> r.max_abs_diff_c is None, r.to_dict()["passed"], r.chaotic
    (True, True, False)
    """
    from gatelens.families.anchored import one_step_errors  # it builds on trace and this module

    if getattr(module, "gatelens_modern", False):
        return verify_modern(module, inputs, state, trace, tol)
    cell = check_module(module)
    refs = reference(module, inputs, state)  # PyTorch's own, once for both traces
    with warnings.catch_warnings():  # the free-running figure is reported, not warned about
        warnings.filterwarnings("ignore", message="trace.method='step'. has left")
        free = trace_diff(module, refs, trace_fn(module, inputs, state, method="step"))
    given = None if trace is None else trace_diff(module, refs, trace)
    one = None
    if not isinstance(inputs, PackedSequence):
        one = one_step_errors(module, *_batch_first(module, inputs, state), tol=tol)
    lstm = cell == "lstm"
    return VerifyResult(
        cell=cell, layers=free if one is None else one.layers,
        one_step_max_abs_diff_h=None if one is None else one.one_step_max_abs_diff_h,
        one_step_max_abs_diff_c=None if one is None else one.one_step_max_abs_diff_c,
        one_step_max_scaled_diff_c=None if one is None else one.one_step_max_scaled_diff_c,
        free_running_max_abs_diff_h=max(x.max_abs_diff_h for x in free),
        free_running_layers=free,
        trace_max_abs_diff_h=None if given is None else max(x.max_abs_diff_h for x in given),
        trace_max_scaled_diff_c=max(x.max_scaled_diff_c for x in given) if given and lstm
        else None, tol=tol, meta={"dtype": str(module.weight_ih_l0.dtype)})


def _maxdiff(a: Tensor, b: Tensor, scaled: bool = False) -> float:
    """max |a − b|, or with ``scaled`` max |a − b| / max(1, |b|)."""
    return _scaled_diff(a, b, b.double().abs().clamp(min=1.0) if scaled else None)


def _scale(ref: Tensor) -> Tensor:
    """max(1, max_t |ref|) per window and unit: (B, T, H) -> (B, 1, H)."""
    return ref.double().abs().amax(dim=1, keepdim=True).clamp(min=1.0)


def _scaled_diff(a: Tensor, b: Tensor, scale: Tensor | None) -> float:
    """max |a − b|, divided by ``scale`` where given (the modern cells' rule: ``_scale``, the
    unit's largest |value| in the window, since the scan's rounding grows with the terms it
    sums, not with h_t)."""
    if not a.numel():
        return 0.0
    diff = (a.double() - b.double()).abs()
    return float((diff if scale is None else diff / scale).max())


def verify_modern(module: nn.Module, inputs: Tensor, state: State = None,
                  trace: Trace | None = None, tol: float = VERIFY_TOL) -> VerifyResult:
    """A gatelens cell (modern.py) against its own forward pass in the parallel form (the
    scan for minGRU/minLSTM; sLSTM has only the sequential step).

    - One-step error (the verdict): each layer's sequential step, fed the scan's own input
      to that layer (x, or LN of the scan's y below), against the scan's h, y and h_n.
    - Free-running: the whole sequential stack (the trace) against the scan.
    - A given trace: against the trajectory the module's forward takes (``scan_mode``: the
      sequential step on CPU, the scan on CUDA), every layer's h and y, and h_n.

    h and y are unbounded here, so each difference is judged scaled by the unit's largest
    |value| in the window, at least 1 (``_scale``); the absolute figures are reported too.

    >>> import torch
    >>> from gatelens.cells.modern import MinGRU
    >>> verify(MinGRU(3, 4, num_layers=2), torch.randn(2, 6, 3)).passed
    True
    """
    L = module.num_layers
    mine = module.trace(inputs, state)  # the sequential stack, free-running
    with torch.no_grad():
        out, final, sig = module.run(inputs, state, parallel=True, signals=True)
        init = module._states(state, inputs)
        one = []
        for k in range(L):
            below = None if k == 0 else sig[f"layer{k - 1}.y"]  # the scan's own input
            inp = inputs if k == 0 else module.norm_in[k - 1](below)
            step, fin = module.layer(k, inp, init[k], parallel=False)
            y = module.block(k, step["h"], below)
            one.append(_modern_layer(k, {"h": step["h"], "y": y}, fin[0], sig, final))
    free = [_modern_layer(k, {s: mine[f"layer{k}.{s}"] for s in ("h", "y")}, mine.h_n[k],
                          sig, final) for k in range(L)]
    given = None
    if trace is not None:
        cuda, mode = inputs.is_cuda, getattr(module, "scan_mode", "auto")
        ref, ref_final = (sig, final) if mode == "parallel" or (mode == "auto" and cuda) \
            else (dict(mine), mine.h_n)
        given = [_modern_layer(k, {s: trace[f"layer{k}.{s}"] for s in ("h", "y")},
                               trace.h_n[k], ref, ref_final) for k in range(L)]
    return VerifyResult(
        cell=module.cell, layers=one,
        one_step_max_abs_diff_h=max(x.max_abs_diff_h for x in one),
        one_step_max_abs_diff_c=None, one_step_max_scaled_diff_c=None,
        free_running_max_abs_diff_h=max(x.max_abs_diff_h for x in free),
        free_running_layers=free,
        trace_max_abs_diff_h=None if given is None else max(x.max_abs_diff_h for x in given),
        tol=tol, meta={"dtype": str(module.weight_ih_l0.dtype)},
        one_step_max_scaled_diff_h=max(x.max_scaled_diff_h for x in one),
        trace_max_scaled_diff_h=None if given is None else max(
            x.max_scaled_diff_h for x in given))


def _modern_layer(k: int, got: dict[str, Tensor], got_final: Tensor, ref: dict[str, Tensor],
                  ref_final: State) -> LayerDiff:
    """One layer's h, y and final h against a reference trajectory: absolute and scaled."""
    h_n = (ref_final if isinstance(ref_final, Tensor) else ref_final[0])[k]  # (B, H)
    h, y = ref[f"layer{k}.h"], ref[f"layer{k}.y"]  # (B, T, H)
    abs_, scaled = 0.0, 0.0
    for a, b, scale in ((got["h"], h, _scale(h)), (got["y"], y, _scale(y)),
                        (got_final, h_n, _scale(h)[:, 0])):
        diff = (a.double() - b.double()).abs()
        abs_, scaled = max(abs_, float(diff.max())), max(scaled, float((diff / scale).max()))
    return LayerDiff(k, False, abs_, None, max_scaled_diff_h=scaled)
