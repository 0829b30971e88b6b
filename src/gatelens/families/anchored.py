"""PyTorch's own states, the one-step check, and the anchored read-out (docs/methods.md).

On a chaotic model two correct implementations of the same cell part: rounding
differences grow like e^{λt}, so the step-by-step re-run (``gatelens.trace``) ends up on a
different trajectory from the module's, though every one of its steps is right. Three
things here keep the read-out on the module's own trajectory:

- ``module_states``: PyTorch's h at every step of every layer and direction (the output
  of eval copies of the layers up to k), and the LSTM's c from PyTorch's own cell run one
  step at a time. The h passed along between those step calls is the module's output
  h_{t−1}, not the call's own: on CPU the two are bitwise equal (``one_step_errors``
  reports the difference), and where a fused kernel rounds differently (cuDNN; not yet
  measured) this keeps c on the module's trajectory instead of a free-running one.
- ``one_step_errors``: each step of the hand cell (equations.py) fed PyTorch's state at
  t − 1 and compared with PyTorch's state at t; every state, and every layer's input,
  comes from that one PyTorch computation. This is the read-out's own error.
- ``anchored_signals``: every gate from the layer's input and PyTorch's own h_{t−1}, c
  by the contraction c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t, so nothing grows.

``free_running_divergence`` is the model's property beside them: how far the hand cell
run on its own outputs drifts from PyTorch's h.

Inputs are padded, batch-first ``(B, T, F)`` tensors whatever the module's
``batch_first``; a state is what the module takes (``(L·D, B, H_out)``, and c). On CUDA,
TF32 is off throughout (docs/methods.md: the one-step check is of float32, not TF32, numerics).

>>> import torch
>>> lstm = torch.nn.LSTM(3, 4, num_layers=2)
>>> x = torch.randn(2, 6, 3)  # (B, T, F), batch first although lstm.batch_first is False
>>> one_step_errors(lstm, x).passed
True
>>> sig = anchored_signals(lstm, x)
>>> list(sig)[:6], sig["layer1.c"].shape
(['layer0.i', 'layer0.f', 'layer0.g', 'layer0.o', 'layer0.c', 'layer0.h'], torch.Size([2, 6, 4]))
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.cells.equations import cell_weights, lstm_gates, lstm_output, step
from gatelens.families.reference import copy_layers, faithful_matmul
from gatelens.readout.trace import State, check_module
from gatelens.readout.trace import trace as trace_fn
from gatelens.readout.trace_types import gate_names
from gatelens.readout.verify import VERIFY_TOL, LayerDiff, passes


def check_inputs(module: nn.Module, inputs: object,
                 state: State = None) -> tuple[str, Tensor, Tensor | None]:
    """The cell name and the initial states h0 (L·D, B, H_out) and c0 (L·D, B, H) (LSTM;
    else None), zeros when ``state`` is None; clear errors for anything else.

    >>> cell, h0, c0 = check_inputs(torch.nn.GRU(3, 4, num_layers=2), torch.randn(5, 7, 3))
    >>> cell, tuple(h0.shape), c0
    ('gru', (2, 5, 4), None)
    """
    cell = check_module(module)
    if isinstance(inputs, PackedSequence):
        raise ValueError("takes a padded batch-first Tensor (B, T, F), not a PackedSequence; "
                         "unpack it with pad_packed_sequence(..., batch_first=True)")
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a Tensor (B, T, F); got {type(inputs).__name__}")
    w = module.weight_ih_l0
    if inputs.ndim != 3 or inputs.shape[-1] != module.input_size or 0 in inputs.shape[:2]:
        raise ValueError(f"inputs must be batch-first (B, T, F) with F = {module.input_size} "
                         f"and B, T >= 1; got shape {tuple(inputs.shape)}")
    if inputs.dtype != w.dtype or inputs.device != w.device:
        raise TypeError(f"inputs must have the module's dtype {w.dtype} and device "
                        f"{w.device}; got {inputs.dtype} on {inputs.device}")
    LD, B = module.num_layers * (2 if module.bidirectional else 1), inputs.shape[0]
    H, H_out = module.hidden_size, getattr(module, "proj_size", 0) or module.hidden_size
    if state is None:
        return cell, w.new_zeros(LD, B, H_out), w.new_zeros(LD, B, H) if cell == "lstm" else None
    h0, c0 = state if cell == "lstm" and isinstance(state, tuple) else (state, None)
    want = [("h0", h0, H_out)] + ([("c0", c0, H)] if cell == "lstm" else [])
    for name, t, size in want:
        if not isinstance(t, Tensor) or tuple(t.shape) != (LD, B, size):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a Tensor of shape {(LD, B, size)} "
                             f"(layers*directions, batch, units); got {got}")
    return cell, h0, c0


def _run(module: nn.RNNBase, x: Tensor, state: State) -> tuple[Tensor, tuple | Tensor]:
    with torch.no_grad(), faithful_matmul(x.device), warnings.catch_warnings():
        # oneDNN cannot do projections and says so; the fallback is PyTorch's own path.
        warnings.filterwarnings("ignore", message=".*projections is not supported with oneDNN")
        return module(x, state)


def _directions(module: nn.RNNBase) -> list[tuple[int, bool, str]]:
    """(layer, reverse, name prefix) of every layer and direction, in trace order."""
    dirs = (False, True) if module.bidirectional else (False,)
    return [(k, r, f"layer{k}{'.reverse' if r else ''}")
            for k in range(module.num_layers) for r in dirs]


def _sequence_h(module: nn.RNNBase, x: Tensor, h0: Tensor, c0: Tensor | None) -> dict[str, Tensor]:
    """PyTorch's h of every layer and direction, (B, T, H_out): layer k is the output of an
    eval copy of layers 0 … k (the top one is the whole module, without dropout)."""
    D = 2 if module.bidirectional else 1
    out: dict[str, Tensor] = {}
    for k in range(module.num_layers):
        n = (k + 1) * D
        ref = copy_layers(module, 0, k + 1, batch_first=True)
        y, _ = _run(ref, x, (h0[:n], c0[:n]) if c0 is not None else h0[:n])  # (B, T, D·H_out)
        for d, part in enumerate(y.chunk(D, dim=-1)):
            out[f"layer{k}{'.reverse' if d else ''}"] = part
    return out


def _layer_input(module: nn.RNNBase, x: Tensor, hs: dict[str, Tensor], k: int) -> Tensor:
    """What layer k reads: x, or the layer below's h of both directions side by side."""
    if k == 0:
        return x
    below = [hs[f"layer{k - 1}"]] + ([hs[f"layer{k - 1}.reverse"]] if module.bidirectional
                                     else [])
    return torch.cat(below, dim=-1)  # (B, T, D·H_out)


def _previous(seq: Tensor, init: Tensor, reverse: bool) -> Tensor:
    """The state each step reads, (B, T, ·): init, then the step before in processing order."""
    init = init.unsqueeze(1)  # (B, 1, ·)
    if reverse:
        return torch.cat([seq[:, 1:], init], dim=1)
    return torch.cat([init, seq[:, :-1]], dim=1)


def _direction_copy(module: nn.RNNBase, layer: int, reverse: bool) -> nn.RNNBase:
    """A fresh one-layer, one-direction eval module of the same class holding one direction."""
    w = cell_weights(module, layer, reverse)
    kw = dict(bias=module.bias, batch_first=True)
    if isinstance(module, nn.LSTM):
        kw["proj_size"] = module.proj_size
    if isinstance(module, nn.RNN):
        kw["nonlinearity"] = module.nonlinearity
    fresh = type(module)(w.w_ih.shape[1], module.hidden_size, **kw)
    fresh = fresh.to(w.w_ih.device, w.w_ih.dtype).eval()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.copy_(getattr(w, {"weight_ih": "w_ih", "weight_hh": "w_hh", "bias_ih": "b_ih",
                                "bias_hh": "b_hh", "weight_hr": "w_hr"}[name[:-3]]))
    return fresh


def _stepped_c(module: nn.RNNBase, k: int, reverse: bool, X: Tensor, h: Tensor, h_init: Tensor,
               c_init: Tensor) -> tuple[Tensor, Tensor]:
    """The LSTM's c at every step from PyTorch's own cell, one call a step, (B, T, H); and the
    h each call returned, (B, T, H_out), to show the calls sat on the module's trajectory."""
    cell = _direction_copy(module, k, reverse)
    T = X.shape[1]
    c_out, h_out = [None] * T, [None] * T
    c_prev = c_init  # (B, H)
    for t in range(T - 1, -1, -1) if reverse else range(T):
        h_prev = h_init if t == (T - 1 if reverse else 0) else h[:, t + 1 if reverse else t - 1]
        y, (_, c_n) = _run(cell, X[:, t : t + 1], (h_prev[None], c_prev[None]))
        c_prev = c_n[0]  # (B, H)
        c_out[t], h_out[t] = c_prev, y[:, 0]
    return torch.stack(c_out, dim=1), torch.stack(h_out, dim=1)


def _states(module: nn.Module, inputs: Tensor, state: State
            ) -> tuple[str, Tensor, Tensor | None, dict[str, Tensor], float | None]:
    cell, h0, c0 = check_inputs(module, inputs, state)
    hs = _sequence_h(module, inputs, h0, c0)
    D = 2 if module.bidirectional else 1
    out: dict[str, Tensor] = {}
    gap = None
    for k, reverse, name in _directions(module):
        if cell == "lstm":
            j = k * D + int(reverse)
            X = _layer_input(module, inputs, hs, k)  # (B, T, F_k)
            out[name + ".c"], h_step = _stepped_c(module, k, reverse, X, hs[name], h0[j], c0[j])
            gap = max(gap or 0.0, _maxdiff(h_step, hs[name]))
        out[name + ".h"] = hs[name]
    return cell, h0, c0, out, gap


def module_states(module: nn.Module, inputs: Tensor, state: State = None) -> dict[str, Tensor]:
    """PyTorch's own state at every step, (B, T, ·), by name: ``layer0.c`` (LSTM),
    ``layer0.h``, … ``layer1.reverse.h`` (see the module docstring for how).

    >>> st = module_states(torch.nn.LSTM(3, 4, bidirectional=True), torch.randn(2, 5, 3))
    >>> list(st)
    ['layer0.c', 'layer0.h', 'layer0.reverse.c', 'layer0.reverse.h']
    """
    return _states(module, inputs, state)[3]


def _maxdiff(a: Tensor, b: Tensor, scaled: bool = False) -> float:
    diff = (a.double() - b.double()).abs()
    if scaled:
        diff = diff / b.double().abs().clamp(min=1.0)
    return float(diff.max())


@dataclass(frozen=True)
class OneStepErrors:
    """The read-out's own error (docs/methods.md "Verification"): pass/fail at ``tol``."""

    cell: str
    layers: list[LayerDiff]  # per layer and direction, over every window, step and unit
    one_step_max_abs_diff_h: float
    one_step_max_abs_diff_c: float | None  # LSTM only
    one_step_max_scaled_diff_c: float | None  # max |Δc| / max(1, |c|): what c is judged by
    # LSTM: max |h of the step calls that gave c − the module's output h| (0 on CPU)
    stepped_vs_sequence_max_abs_diff_h: float | None = None
    tol: float = VERIFY_TOL

    @property
    def passed(self) -> bool:
        """|Δh| ≤ tol, and |Δc| / max(1, |c|) ≤ tol."""
        return passes(self.one_step_max_abs_diff_h, self.one_step_max_scaled_diff_c, self.tol)

    def to_dict(self) -> dict:
        """Plain JSON-ready dict (``passed`` included)."""
        return {**asdict(self), "passed": self.passed}


def one_step_errors(module: nn.Module, inputs: Tensor, state: State = None,
                    tol: float = VERIFY_TOL) -> OneStepErrors:
    """Each step of the hand cell fed PyTorch's state at t − 1, against PyTorch's state at t.

    >>> r = one_step_errors(torch.nn.GRU(3, 4, batch_first=True), torch.randn(2, 5, 3))
    >>> r.passed, r.one_step_max_abs_diff_c is None, r.one_step_max_abs_diff_h < 1e-6
    (True, True, True)
    """
    cell, h0, c0, st, gap = _states(module, inputs, state)
    D = 2 if module.bidirectional else 1
    hs = {n[:-2]: t for n, t in st.items() if n.endswith(".h")}
    layers = []
    with torch.no_grad(), faithful_matmul(inputs.device):  # TF32 is not float32
        for k, reverse, name in _directions(module):
            j = k * D + int(reverse)
            X = _layer_input(module, inputs, hs, k)  # (B, T, F_k)
            h_prev = _previous(hs[name], h0[j], reverse)  # (B, T, H_out)
            c_prev = None if c0 is None else _previous(st[name + ".c"], c0[j], reverse)
            sig = step(cell_weights(module, k, reverse), X, h_prev, c_prev)
            dc = sc = None
            if cell == "lstm":
                dc, sc = (_maxdiff(sig["c"], st[name + ".c"], s) for s in (False, True))
            layers.append(LayerDiff(k, reverse, _maxdiff(sig["h"], hs[name]), dc, sc))
    lstm = cell == "lstm"
    return OneStepErrors(
        cell=cell, layers=layers,
        one_step_max_abs_diff_h=max(x.max_abs_diff_h for x in layers),
        one_step_max_abs_diff_c=max(x.max_abs_diff_c for x in layers) if lstm else None,
        one_step_max_scaled_diff_c=max(x.max_scaled_diff_c for x in layers) if lstm else None,
        stepped_vs_sequence_max_abs_diff_h=gap, tol=tol)


def anchored_signals(module: nn.Module, inputs: Tensor, state: State = None
                     ) -> dict[str, Tensor]:
    """Every signal of the trajectory the module took, (B, T, ·), named as ``gatelens.trace``.

    Gates from each layer's input and PyTorch's own h_{t−1}; LSTM c by the contraction
    c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t and h = o ⊙ tanh(c) (projected: m, then h = W_hr m);
    GRU and RNN h are PyTorch's own.

    >>> sig = anchored_signals(torch.nn.RNN(3, 4, batch_first=True), torch.randn(2, 5, 3))
    >>> list(sig), sig["layer0.pre"].shape
    (['layer0.pre', 'layer0.h'], torch.Size([2, 5, 4]))
    """
    cell, h0, c0 = check_inputs(module, inputs, state)
    hs = _sequence_h(module, inputs, h0, c0)
    D = 2 if module.bidirectional else 1
    out: dict[str, Tensor] = {}
    with torch.no_grad(), faithful_matmul(inputs.device):  # TF32 is not float32
        for k, reverse, name in _directions(module):
            j = k * D + int(reverse)
            w = cell_weights(module, k, reverse)
            X = _layer_input(module, inputs, hs, k)  # (B, T, F_k)
            h_prev = _previous(hs[name], h0[j], reverse)  # (B, T, H_out)
            if cell != "lstm":
                sig = step(w, X, h_prev)
                sig["h"] = hs[name]
            else:
                sig = lstm_gates(w, X, h_prev)  # i, f, g, o: (B, T, H) each
                sig["c"] = _contract(sig["f"], sig["i"] * sig["g"], c0[j], reverse)
                sig.update(lstm_output(w, sig["o"], sig["c"]))
            out.update({f"{name}.{s}": t for s, t in sig.items()})
    proj = cell == "lstm" and module.proj_size > 0
    names = gate_names(cell, module.num_layers, module.bidirectional, proj=proj)
    return {n: out[n] for n in names}


def _contract(f: Tensor, u: Tensor, c_init: Tensor, reverse: bool) -> Tensor:
    """c_t = f_t ⊙ c_{t−1} + u_t in processing order, from c_init (B, H); (B, T, H)."""
    T = f.shape[1]
    c = [None] * T
    prev = c_init
    for t in range(T - 1, -1, -1) if reverse else range(T):
        prev = f[:, t] * prev + u[:, t]  # (B, H)
        c[t] = prev
    return torch.stack(c, dim=1)


@dataclass(frozen=True)
class FreeRunningDivergence:
    """max |h_hand − h_torch| with the hand cell run on its own outputs (a model property)."""

    max_abs_diff_h: float
    layers: dict[str, float]  # "layer0", "layer0.reverse", … -> max |Δh| of that one

    def to_dict(self) -> dict:
        """Plain JSON-ready dict."""
        return asdict(self)


def free_running_divergence(module: nn.Module, inputs: Tensor,
                            state: State = None) -> FreeRunningDivergence:
    """How far ``gatelens.trace`` (the step-by-step re-run) drifts from PyTorch's h.

    >>> d = free_running_divergence(torch.nn.LSTM(3, 4), torch.randn(2, 5, 3))
    >>> list(d.layers), d.max_abs_diff_h < 1e-5
    (['layer0'], True)
    """
    _, h0, c0 = check_inputs(module, inputs, state)
    hs = _sequence_h(module, inputs, h0, c0)
    x = inputs if module.batch_first else inputs.transpose(0, 1)
    with warnings.catch_warnings():  # leaving the trajectory is what is measured here
        warnings.filterwarnings("ignore", message="trace.method='step'. has left")
        tr = trace_fn(module, x, state, names=[n + ".h" for n in hs], method="step")
    layers = {n: _maxdiff(tr[n + ".h"], h) for n, h in hs.items()}
    return FreeRunningDivergence(max(layers.values()), layers)
