"""Opened cells: every gate of an nn.LSTM, nn.GRU or nn.RNN, step by step.

gatelens's own cells (modern.py: minGRU, minLSTM, sLSTM) are traced by their own
``trace`` method; ``trace`` hands them over and keeps only ``names``.

``trace(module, inputs, state)`` takes exactly what the module's own forward takes and
re-runs it from the module's weights (``run_stack`` here runs the layers, cells.py has the
equations), returning a Trace of ``(B, T, H)`` tensors named ``layer0.f``,
``layer1.reverse.h``, ... (trace_types.py).

Semantics worth knowing:
- Inference only: the trace runs under ``torch.no_grad()`` and never applies the dropout
  between layers, as if the module were in ``eval()`` mode. A module in training mode
  with ``dropout > 0`` will differ from the trace; that is by design.
- The module is only read: no hooks, no re-registered or modified parameters.
- Tensors may be non-contiguous views of shared buffers (time-major underneath); use
  ``.reshape`` or ``.contiguous()`` rather than ``.view``.
- On CUDA, TF32 is switched off while tracing (PyTorch's float32 numerics, not TF32's).

>>> import torch
>>> lstm = torch.nn.LSTM(input_size=3, hidden_size=4, batch_first=True)
>>> x = torch.randn(2, 5, 3)
>>> tr = trace(lstm, x)
>>> tr["layer0.f"].shape
torch.Size([2, 5, 4])
>>> out, (h_n, c_n) = lstm(x)
>>> bool((tr["layer0.h"] - out).abs().max() < 1e-5)
True
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from gatelens.cells.kernels import (
    Schedule,
    final_state,
    layer_weights,
    project,
    run_gru,
    run_lstm,
    run_rnn,
)
from gatelens.families.reference import faithful_matmul, run_module
from gatelens.families.spec import cell_of_mode, cell_spec
from gatelens.readout.trace_types import Trace, gate_names

State = Tensor | tuple[Tensor, Tensor] | None
ACCEPTED = "nn.LSTM, nn.GRU or nn.RNN (tanh or relu)"


@dataclass
class _Input:
    """Inputs checked and brought to the internal layout."""

    cell: str
    x: Tensor  # (T, F, B), batch sorted by length for packed input
    h0: Tensor  # (L*D, H_out, B)
    c0: Tensor | None  # (L*D, H, B)
    lengths: Tensor | None  # (B,) sorted, packed only
    unsorted: Tensor | None  # (B,) the module's unsorted_indices, packed only
    lengths_orig: Tensor | None  # (B,) in the caller's order, for Trace.lengths
    unbatched: bool


def check_module(module: object) -> str:
    """The cell name of a supported module; TypeError naming the type otherwise.

    >>> check_module(torch.nn.GRU(2, 3))
    'gru'
    """
    cell = cell_of_mode(module.mode) if isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)) else None
    if cell is None:
        raise TypeError(f"trace() takes an {ACCEPTED}; got {type(module).__name__}")
    return cell


def _check(module: nn.RNNBase, inputs: object, state: State) -> _Input:
    """Validate everything before any work; errors say what was expected and what came."""
    cell = check_module(module)
    w = module.weight_ih_l0
    L, D = module.num_layers, 2 if module.bidirectional else 1
    H, P = module.hidden_size, getattr(module, "proj_size", 0)
    lengths = unsorted = lengths_orig = None
    if isinstance(inputs, PackedSequence):
        _check_tensor("inputs.data", inputs.data, w)
        if inputs.data.ndim != 2 or inputs.data.shape[1] != module.input_size:
            raise ValueError(f"packed inputs.data must be (N, {module.input_size}); "
                             f"got {tuple(inputs.data.shape)}")
        padded, lens = pad_packed_sequence(inputs, batch_first=True)  # (B, T, F), caller order
        lens = lens.to(padded.device)
        sorted_idx = inputs.sorted_indices
        if sorted_idx is None:
            sorted_idx = torch.arange(padded.shape[0], device=padded.device)
        unsorted = inputs.unsorted_indices
        if unsorted is None:
            unsorted = torch.arange(padded.shape[0], device=padded.device)
        lengths_orig, lengths = lens, lens[sorted_idx]
        xb, unbatched = padded[sorted_idx], False
    elif isinstance(inputs, Tensor):
        _check_tensor("inputs", inputs, w)
        if inputs.ndim not in (2, 3) or inputs.shape[-1] != module.input_size:
            layout = "(B, T, F)" if module.batch_first else "(T, B, F)"
            raise ValueError(f"inputs must be {layout} or unbatched (T, F) with F = "
                             f"{module.input_size}; got shape {tuple(inputs.shape)}")
        unbatched = inputs.ndim == 2
        xb = inputs.unsqueeze(0) if unbatched else inputs
        if module.batch_first is False and not unbatched:
            xb = xb.transpose(0, 1)
        sorted_idx = None
    else:
        raise TypeError(f"inputs must be a Tensor or PackedSequence; got {type(inputs).__name__}")
    B, T = xb.shape[0], xb.shape[1]
    if B == 0 or T == 0:
        raise ValueError(f"inputs must hold at least one step of one sequence; got B={B}, T={T}")
    h0, c0 = _check_state(module, cell, state, B, unbatched, L * D, H, P or H, w)
    if sorted_idx is not None:
        h0 = h0[:, sorted_idx]
        c0 = None if c0 is None else c0[:, sorted_idx]
    return _Input(
        cell=cell,
        x=xb.permute(1, 2, 0).contiguous(),  # (T, F, B)
        h0=h0.transpose(1, 2).contiguous(),  # (L*D, H_out, B)
        c0=None if c0 is None else c0.transpose(1, 2).contiguous(),  # (L*D, H, B)
        lengths=lengths, unsorted=unsorted, lengths_orig=lengths_orig, unbatched=unbatched,
    )


def _check_tensor(what: str, t: Tensor, w: Tensor) -> None:
    if not t.is_floating_point() or t.dtype != w.dtype:
        raise TypeError(f"{what} must have the module's dtype {w.dtype}; got {t.dtype}")
    if t.device != w.device:
        raise ValueError(f"{what} must be on the module's device {w.device}; got {t.device}")


def _check_state(module: nn.RNNBase, cell: str, state: State, B: int, unbatched: bool,
                 LD: int, H: int, H_out: int, w: Tensor) -> tuple[Tensor, Tensor | None]:
    """Initial states as (L*D, B, ·); zeros when ``state`` is None."""
    zeros = w.new_zeros
    if state is None:
        return zeros(LD, B, H_out), zeros(LD, B, H) if cell == "lstm" else None
    if cell == "lstm":
        if not (isinstance(state, tuple) and len(state) == 2):
            raise TypeError(f"an LSTM's state is a tuple (h0, c0); got {type(state).__name__}")
        pairs = [("h0", state[0], H_out), ("c0", state[1], H)]
    else:
        if not isinstance(state, Tensor):
            raise TypeError(f"a {type(module).__name__}'s state is a Tensor h0; "
                            f"got {type(state).__name__}")
        pairs = [("h0", state, H)]
    out = []
    for name, t, size in pairs:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor; got {type(t).__name__}")
        _check_tensor(name, t, w)
        want = (LD, size) if unbatched else (LD, B, size)
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want} (layers*directions, "
                             f"{'' if unbatched else 'batch, '}units); got {tuple(t.shape)}")
        out.append(t.unsqueeze(1) if unbatched else t)
    return out[0], (out[1] if cell == "lstm" else None)


def _check_names(names: Sequence[str] | None, valid: list[str]) -> list[str]:
    if names is None:
        return valid
    if isinstance(names, str):
        raise TypeError(f"names must be a list of names, e.g. [{names!r}]; got a str")
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"unknown trace names {bad}; this module has {valid}")
    return list(names)


def run_stack(module: nn.RNNBase, x: Tensor, h0: Tensor, c0: Tensor | None,
              lengths: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """Every layer and direction of ``module`` on ``x`` (T, F, B) from states (L*D, ·, B).

    Returns the signal buffers by trace name, each (T, R, B), and h_n (L*D, H_out, B),
    c_n (L*D, H, B) or None. Dropout between layers is not applied (inference).
    """
    cell = cell_of_mode(module.mode)
    D = 2 if module.bidirectional else 1
    T, _, B = x.shape
    H, P = module.hidden_size, getattr(module, "proj_size", 0)
    H_out = P or H
    G = cell_spec(cell).n_chunks * H
    bufs: dict[str, Tensor] = {}
    h_n, c_n = [], []
    for layer in range(module.num_layers):
        # Both directions write their h side by side: the next layer's input, (T, D*H_out, B).
        h_cat = x.new_empty(T, D * H_out, B)
        for d in range(D):
            reverse = d == 1
            w = layer_weights(module, cell, layer, reverse)
            s = Schedule(T, reverse, lengths)
            k = layer * D + d
            xw = project(w, x, x.new_empty(T, G, B))  # (T, G, B)
            h_buf = h_cat[:, d * H_out : (d + 1) * H_out]  # (T, H_out, B)
            if cell == "lstm":
                sig = run_lstm(xw, w, h0[k], c0[k], s, h_buf)
                c_n.append(final_state(sig["c"], s))
            elif cell == "gru":
                sig = run_gru(xw, w, h0[k], s, h_buf)
            else:
                sig = run_rnn(xw, w, h0[k], s, h_buf, relu=cell == "rnn_relu")
            h_n.append(final_state(h_buf, s))
            prefix = f"layer{layer}{'.reverse' if reverse else ''}."
            bufs.update({prefix + name: t for name, t in sig.items()})
        x = h_cat
    return bufs, torch.stack(h_n), (torch.stack(c_n) if c_n else None)



#: Read-out methods; "parallel" is the former name of "anchored" (the same computation).
METHODS = ("anchored", "step", "parallel")


def trace(module: nn.Module, inputs: Tensor | PackedSequence, state: State = None, *,
          names: Sequence[str] | None = None, method: str | None = None) -> Trace:
    """Every gate of ``module`` on ``inputs``, on the trajectory the module itself took.

    ``inputs`` and ``state`` are what the module's forward takes (batch_first or not,
    unbatched (T, F), PackedSequence; h0 or (h0, c0)). ``names`` keeps only those signals.

    ``method="anchored"`` (the default for padded input) computes each layer's gates from
    PyTorch's own h_{t−1} of that layer and the LSTM's c by the contracting recurrence
    c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t, so the trace is the module's trajectory even when the
    model is chaotic. ``method="step"`` (the default for a PackedSequence) re-runs every
    step on its own outputs; it then checks its top layer against the module's output and
    warns (and records ``meta["free_running_max_abs_diff_h"]``) when it has left the
    module's trajectory by more than 1e-5. See docs/methods.md, "Anchored read-out".

    >>> gru = torch.nn.GRU(2, 3, num_layers=2)
    >>> tr = trace(gru, torch.randn(4, 5, 2))  # (T, B, F): batch_first=False
    >>> list(tr)[:4], tr["layer1.z"].shape, tr.h_n.shape
    (['layer0.r', 'layer0.z', 'layer0.n', 'layer0.h'], torch.Size([5, 4, 3]), torch.Size([2, 5, 3]))
    """
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if getattr(module, "gatelens_modern", False):  # gatelens's own cells trace themselves
        tr = module.trace(inputs, state)
        keep = _check_names(names, list(tr))
        return tr if names is None else Trace(**{**tr.__dict__,
                                                 "tensors": {n: tr[n] for n in keep}})
    spec = _check(module, inputs, state)
    method = {"parallel": "anchored"}.get(method, method) or (
        "step" if spec.lengths is not None else "anchored")
    if method == "anchored" and spec.lengths is not None:
        raise ValueError("method='anchored' takes padded input, not a PackedSequence")
    keep = _check_names(names, _names_of(module, spec.cell))
    meta: dict = {"method": method}
    with torch.no_grad(), faithful_matmul(spec.x.device):
        if method == "anchored":
            bufs, h_n, c_n = _run_anchored(module, spec)
        else:
            bufs, h_n, c_n = run_stack(module, spec.x, spec.h0, spec.c0, spec.lengths)
            meta["free_running_max_abs_diff_h"] = _left_trajectory(module, inputs, state, bufs,
                                                                   spec)
    return _assemble(module, spec, {n: bufs[n] for n in keep}, h_n, c_n, **meta)


def _run_anchored(module: nn.RNNBase, spec: _Input) -> tuple[dict[str, Tensor], Tensor,
                                                             Tensor | None]:
    """The anchored read-out (anchored.py) in run_stack's layout: (T, R, B) buffers."""
    from gatelens.families.anchored import anchored_signals  # it builds on this module

    x = spec.x.permute(2, 0, 1)  # (B, T, F)
    h0 = spec.h0.transpose(1, 2)  # (L*D, B, H_out)
    state = h0 if spec.c0 is None else (h0, spec.c0.transpose(1, 2))
    sig = anchored_signals(module, x, state)
    bufs = {n: t.permute(1, 2, 0) for n, t in sig.items()}  # (T, R, B)
    h_n, c_n = [], []
    for k in range(module.num_layers):
        for d in ("", ".reverse") if module.bidirectional else ("",):
            last = 0 if d else -1  # the reverse direction ends at t = 0
            h_n.append(bufs[f"layer{k}{d}.h"][last])
            if spec.c0 is not None:
                c_n.append(bufs[f"layer{k}{d}.c"][last])
    return bufs, torch.stack(h_n), (torch.stack(c_n) if c_n else None)


def _left_trajectory(module: nn.RNNBase, inputs: Tensor | PackedSequence, state: State,
                     bufs: dict[str, Tensor], spec: _Input) -> float:
    """max |h_step − h_module| of the top layer; warns above 1e-5 (the re-run has parted
    from the module's trajectory: a chaotic model, see docs/methods.md)."""
    out, _, _ = run_module(module, inputs, state)  # (B, T', D*H_out)
    top = module.num_layers - 1
    dirs = ("", ".reverse") if module.bidirectional else ("",)
    mine = torch.cat([bufs[f"layer{top}{d}.h"] for d in dirs], dim=1).permute(2, 0, 1)
    if spec.unsorted is not None:
        mine = mine.index_select(0, spec.unsorted)
    mine = mine[:, : out.shape[1]]  # (B, T', D*H_out)
    diff = float((mine.double() - out.double()).abs().max()) if out.numel() else 0.0
    if diff > 1e-5:
        warnings.warn(f"trace(method='step') has left the module's trajectory: its top-layer h "
                      f"differs from the module's output by {diff:.3g} (a chaotic model parts "
                      "two correct implementations); method='anchored' follows the module",
                      stacklevel=3)
    return diff


def _names_of(module: nn.RNNBase, cell: str) -> list[str]:
    proj = cell == "lstm" and module.proj_size > 0
    return gate_names(cell, module.num_layers, module.bidirectional, proj=proj)


def _assemble(module: nn.RNNBase, spec: _Input, bufs: dict[str, Tensor], h_n: Tensor,
              c_n: Tensor | None, **meta: object) -> Trace:
    """(T, R, B) buffers -> (B, T, R) views; packed: back to the caller's batch order."""
    tensors = {n: b.permute(2, 0, 1) for n, b in bufs.items()}  # (B, T, R)
    h_n = h_n.transpose(1, 2)  # (L*D, B, H_out)
    c_n = None if c_n is None else c_n.transpose(1, 2)
    if spec.unsorted is not None:
        tensors = {n: t.index_select(0, spec.unsorted) for n, t in tensors.items()}
        h_n = h_n.index_select(1, spec.unsorted)
        c_n = None if c_n is None else c_n.index_select(1, spec.unsorted)
    if spec.unbatched:
        h_n = h_n.squeeze(1)
        c_n = None if c_n is None else c_n.squeeze(1)
    info = {"dtype": str(spec.x.dtype), "device": str(spec.x.device),
            "batch_first": module.batch_first, "unbatched": spec.unbatched}
    info.update(meta)
    return Trace(cell=spec.cell, num_layers=module.num_layers, bidirectional=module.bidirectional,
                 tensors=tensors, lengths=spec.lengths_orig, h_n=h_n, c_n=c_n, meta=info,
                 proj_size=getattr(module, "proj_size", 0))


def trace_chunked(module: nn.Module, inputs: Tensor, chunk: int = 256, state: State = None, *,
                  names: Sequence[str] | None = None) -> Trace:
    """``trace(method="step")`` in chunks of ``chunk`` steps that carry the state: the same
    numbers, bitwise, with working memory bounded by one chunk (plus the kept ``names``'
    read-out). It re-runs steps, so on a chaotic model it may part from the module's
    trajectory (``trace``'s anchored default does not); ``verify`` says which it is.

    Unidirectional, unpacked input only: a reverse direction starts from the end of the
    text, so it cannot be carried forward chunk by chunk.

    >>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
    >>> x = torch.randn(2, 10, 3)
    >>> tr = trace_chunked(lstm, x, chunk=4, names=["layer0.f"])
    >>> list(tr), torch.equal(tr["layer0.f"], trace(lstm, x, method="step")["layer0.f"])
    (['layer0.f'], True)
    """
    if isinstance(inputs, PackedSequence):
        raise ValueError("trace_chunked takes a padded Tensor, not a PackedSequence; "
                         "use trace() for packed input")
    spec = _check(module, inputs, state)
    if module.bidirectional:
        raise ValueError("trace_chunked cannot carry a bidirectional module's reverse "
                         "direction forward; use trace() for bidirectional modules")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int; got {chunk!r}")
    keep = _check_names(names, _names_of(module, spec.cell))
    T = spec.x.shape[0]
    out: dict[str, Tensor] = {}
    h, c = spec.h0, spec.c0
    with torch.no_grad(), faithful_matmul(spec.x.device):
        for t0 in range(0, T, chunk):
            bufs, h, c = run_stack(module, spec.x[t0 : t0 + chunk], h, c)
            for n in keep:
                if n not in out:
                    out[n] = bufs[n].new_empty((T,) + bufs[n].shape[1:])  # (T, R, B)
                out[n][t0 : t0 + chunk] = bufs[n]
            del bufs  # free the chunk's working buffers before the next one
    return _assemble(module, spec, out, h, c, method="step", chunk=chunk)
