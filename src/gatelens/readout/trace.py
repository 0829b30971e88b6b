"""Opened cells: every gate of a recurrent module, step by step, through its family.

``trace(module, inputs, state)`` takes exactly what the module's own forward takes and
returns a Trace of ``(B, T, H)`` tensors named ``layer0.f``, ``layer1.reverse.h``, ...
(trace_types.py), computed by the module's family (gatelens.families) from the module's own
weights.

Semantics worth knowing:
- Inference only: the trace runs under ``torch.no_grad()`` and never applies the dropout
  between layers, as if the module were in ``eval()`` mode. A module in training mode
  with ``dropout > 0`` will differ from the trace; that is by design.
- The module is only read: no re-registered or modified parameters; parametrized weights
  (weight_norm, spectral_norm in eval mode, prune) are read as the forward computes them.
  A module with hooks runs its own call once, hooks included (readout/own_call.py).
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
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gatelens.cells.numerics import faithful_matmul
from gatelens.families.base import Call, Family, Readout, Reference
from gatelens.families.official_layers import read_layers, streams
from gatelens.families.registry import open_family
from gatelens.families.spec import layer_name
from gatelens.families.torch_ops import as_computed
from gatelens.families.torch_rnn import TorchRNNFamily, max_diff
from gatelens.readout.own_call import OwnCall, own_call
from gatelens.readout.trace_types import Trace

State = Tensor | tuple[Tensor, ...] | None

#: Read-out methods; "parallel" is the former name of "anchored" (the same computation).
METHODS = ("own", "anchored", "step", "parallel")


def check_names(names: Sequence[str] | None, valid: list[str]) -> list[str]:
    """``names`` checked against the module's trace names (all of them when None)."""
    if names is None:
        return valid
    if isinstance(names, str):
        raise TypeError(f"names must be a list of names, e.g. [{names!r}]; got a str")
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"unknown trace names {bad}; this module has {valid}")
    return list(names)


def check_module(module: object) -> str:
    """The cell name of a module gatelens opens; TypeError naming the type otherwise.

    >>> check_module(torch.nn.GRU(2, 3)), check_module(torch.nn.LSTMCell(2, 3))
    ('gru', 'lstm')
    """
    return open_family(module).cell


def assemble(fam: Family, call: Call, ro: Readout, names: Sequence[str] | None = None,
             **meta: Any) -> Trace:
    """A family's read-out as a Trace, in the caller's layout (unbatched states squeezed)."""
    keep = check_names(names, fam.names())
    h_n, c_n = ro.h_n, ro.c_n
    if call.layout.get("unbatched"):
        h_n = None if h_n is None else h_n.squeeze(1)
        c_n = None if c_n is None else c_n.squeeze(1)
    info = {"dtype": str(call.inputs.dtype), "device": str(call.inputs.device),
            "batch_first": call.layout.get("batch_first", True),
            "unbatched": bool(call.layout.get("unbatched")), "family": fam.name,
            **ro.meta, **meta}
    # a read-out that replays its layers as they are read (official_layers.LayerReplay) is
    # kept as it is, its own names
    tensors = {n: ro.signals[n] for n in keep} if isinstance(ro.signals, dict) else ro.signals
    return Trace(cell=fam.cell, num_layers=fam.num_layers, bidirectional=fam.bidirectional,
                 tensors=tensors, lengths=call.layout.get("lengths"),
                 h_n=h_n, c_n=c_n, meta=info, proj_size=getattr(fam.module, "proj_size", 0))


def resolve_method(method: str | None, call: Call) -> str:
    """The read-out method: "anchored" for padded input (the module's own values first where
    its family reads them, ``own_or_anchored``), "step" for a PackedSequence."""
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    packed = call.layout.get("packed") is not None
    method = {"parallel": "anchored"}.get(method, method) or ("step" if packed else "anchored")
    if method in ("anchored", "own") and packed:
        raise ValueError(f"method={method!r} takes padded input, not a PackedSequence")
    return method


def own_or_anchored(fam: Family, call: Call, ref: Reference, method: str | None = None
                    ) -> Readout:
    """The read-out of a reference: every signal as the module itself computed it where its
    family reads them from the module's own forward (``Family.read_own``: the Mamba layers,
    Gated DeltaNet, KDA, RG-LRU, transformers' xLSTM and RWKV-4, RWKV-7),
    else the anchored hand cell (``Family.read``); ``method`` "anchored" always the hand cell,
    "own" never (a family that cannot is refused in one line)."""
    ro = None if method == "anchored" else fam.read_own(call, ref)
    hand = None if ro is None else ro.meta.get("hand_cell_layers")
    if (ro is None or hand) and method == "own":
        which = f" for layers {hand}" if hand else ""
        raise ValueError(f"method='own' reads the module's own gates from its forward, which "
                         f"the {fam.name} family does not{which}; use 'anchored'")
    return fam.read(call, ref) if ro is None else ro


def trace(module: nn.Module, inputs: Tensor | PackedSequence, state: State = None, *,
          names: Sequence[str] | None = None, method: str | None = None,
          hooks: bool = True) -> Trace:
    """Every gate of ``module`` on ``inputs``, on the trajectory the module itself took.

    ``inputs`` and ``state`` are what the module's forward takes (batch_first or not,
    unbatched (T, F), PackedSequence; h0 or (h0, c0)). ``names`` keeps only those signals.
    A cell (nn.LSTMCell, GRUCell, RNNCell) takes (B, T, F), the steps a loop would take,
    and its own state ((h, c) or h, (B, H)); it is read as the one-layer module on what
    its own forward returns one call a step (docs/formats.md).

    ``method="anchored"`` (the default for padded input) computes each layer's gates from
    the module's own h_{t−1} of that layer and the LSTM's c by the contracting recurrence
    c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t, so the trace is the module's trajectory even when the
    model is chaotic. Where a family reads every state and gate from the module's own
    whole-sequence forward (transformers' Mamba-1 and Mamba-2 and the hybrids' Mamba layers,
    Gated DeltaNet, KDA, RG-LRU, xLSTM, RWKV-4 and RWKV-7: families/forward_scan.py,
    rwkv4_scan.py, rwkv7_scan.py),
    the default is ``method="own"``: those values themselves, at about the cost of one
    forward, no hand cell run (``meta["method"]`` says which; "anchored" forces the hand
    cell). ``method="step"`` (the default for a PackedSequence) re-runs every
    step on its own outputs; it then checks its top layer against the module's output and
    warns (and records ``meta["free_running_max_abs_diff_h"]``) when it has left the
    module's trajectory by more than 1e-5. See docs/methods.md, "Anchored read-out".

    A module with forward hooks or pre-hooks is read on its own call, hooks included
    (readout/own_call.py): the trace is computed on what its forward received (a pre-hook's
    inputs) and compared with what the call returned (``meta["own_call_max_abs_diff"]``); a
    hook that changes the output is refused in one line naming it. ``hooks=False`` takes
    ``inputs`` as what the forward already received (a call a hook recorded).

    >>> gru = torch.nn.GRU(2, 3, num_layers=2)
    >>> tr = trace(gru, torch.randn(4, 5, 2))  # (T, B, F): batch_first=False
    >>> list(tr)[:4], tr["layer1.z"].shape, tr.h_n.shape
    (['layer0.r', 'layer0.z', 'layer0.n', 'layer0.h'], torch.Size([5, 4, 3]), torch.Size([2, 5, 3]))
    """
    fam = open_family(module)
    own = through_hooks(fam, inputs, state, "trace()", hooks)
    call = fam.check(own.inputs, own.state)
    how = resolve_method(method, call)
    check_names(names, fam.names())
    with torch.no_grad(), faithful_matmul(call.inputs.device), as_computed(module):
        if how in ("anchored", "own"):
            if names is not None and method != "anchored" and streams(fam):
                # only the layers named are replayed (families/official_layers.py)
                ro = read_layers(fam, call, list(names))
                return assemble(fam, call, ro, names, **own_meta(fam, own, ro))
            ro = own_or_anchored(fam, call, fam.reference(call), method and how)
            return assemble(fam, call, ro, names, **own_meta(fam, own, ro))
        ro = fam.rerun(call)
        meta = own_meta(fam, own, ro)
        if isinstance(fam, TorchRNNFamily):
            meta["free_running_max_abs_diff_h"] = _left_trajectory(fam, call, ro)
        return assemble(fam, call, ro, names, **meta)


def through_hooks(fam: Family, inputs: Any, state: Any, what: str,
                  hooks: bool = True) -> OwnCall:
    """The module's own call when it has hooks (readout/own_call.py): what its forward
    received; ``hooks`` False: ``inputs`` already are (a call a hook recorded)."""
    if not hooks:
        return OwnCall(inputs, state, None, [])
    return own_call(fam.module, inputs, state, what, split=fam.split_call,
                    runs_hooks=isinstance(fam, TorchRNNFamily))


def own_meta(fam: Family, own: OwnCall, ro: Readout) -> dict:
    """A trace's meta of the module's own call: the hooks that ran, and the read-out against
    what the call returned (``own_call_max_abs_diff``)."""
    meta = own.meta()
    if meta and own.output is not None:
        try:
            meta["own_call_max_abs_diff"] = fam.output_diff(ro, own.output)
        except KeyError:  # trace_chunked kept only some names: not the top layer's h
            meta["own_call_max_abs_diff"] = None
    return meta


def read(fam: Family, call: Call, ref: Reference) -> Trace:
    """The trace of a checked call on a reference already computed (compute once): the
    module's own values where its family reads them, else anchored (``own_or_anchored``)."""
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        return assemble(fam, call, own_or_anchored(fam, call, ref))


def _left_trajectory(fam: TorchRNNFamily, call: Call, ro: Readout) -> float:
    """max |h_step − h_module| of the top layer; warns above 1e-5 (the re-run has parted
    from the module's trajectory: a chaotic model, see docs/methods.md)."""
    out = fam.padded(fam.module, fam.run(fam.module, call)[0])  # (B, T', D·H_out)
    top = [layer_name(fam.num_layers - 1, bool(d)) + ".h" for d in range(fam.directions)]
    mine = torch.cat([ro.signals[n] for n in top], dim=-1)[:, : out.shape[1]]
    diff = max_diff(mine, out)
    if not diff <= 1e-5:  # NaN too
        warnings.warn(f"trace(method='step') has left the module's trajectory: its top-layer h "
                      f"differs from the module's output by {diff:.3g} (a chaotic model parts "
                      "two correct implementations); method='anchored' follows the module",
                      stacklevel=3)
    return diff


def trace_chunked(module: nn.Module, inputs: Tensor, chunk: int = 256, state: State = None, *,
                  names: Sequence[str] | None = None) -> Trace:
    """``trace(method="step")`` in chunks of ``chunk`` steps that carry the state: the same
    numbers, bitwise, with working memory bounded by one chunk (plus the kept ``names``'
    read-out). It re-runs steps, so on a chaotic model it may part from the module's
    trajectory (``trace``'s anchored default does not); ``verify`` says which it is.

    nn.LSTM / nn.GRU / nn.RNN, unidirectional, unpacked input only: a reverse direction
    starts from the end of the text, so it cannot be carried forward chunk by chunk.

    >>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
    >>> x = torch.randn(2, 10, 3)
    >>> tr = trace_chunked(lstm, x, chunk=4, names=["layer0.f"])
    >>> list(tr), torch.equal(tr["layer0.f"], trace(lstm, x, method="step")["layer0.f"])
    (['layer0.f'], True)
    """
    if isinstance(inputs, PackedSequence):
        raise ValueError("trace_chunked takes a padded Tensor, not a PackedSequence; "
                         "use trace() for packed input")
    fam = open_family(module, "trace_chunked()")
    if not isinstance(fam, TorchRNNFamily):
        raise TypeError(f"trace_chunked() takes nn.LSTM, nn.GRU or nn.RNN; got "
                        f"{type(module).__name__} (use trace())")
    own = through_hooks(fam, inputs, state, "trace_chunked()")
    call = fam.check(own.inputs, own.state)
    if fam.bidirectional:
        raise ValueError("trace_chunked cannot carry a bidirectional module's reverse "
                         "direction forward; use trace() for bidirectional modules")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int; got {chunk!r}")
    keep = check_names(names, fam.names())
    x = call.inputs.permute(1, 2, 0).contiguous()  # (T, F, B)
    T = x.shape[0]
    parts = [s.transpose(1, 2).contiguous() for s in call.state]  # (L, ·, B)
    out: dict[str, Tensor] = {}
    with torch.no_grad(), faithful_matmul(x.device), as_computed(module):
        for t0 in range(0, T, chunk):
            bufs, h, c = fam.run_kernels(x[t0 : t0 + chunk], *parts)
            parts = [h] if c is None else [h, c]
            for n in keep:
                if n not in out:
                    out[n] = bufs[n].new_empty((T,) + bufs[n].shape[1:])  # (T, R, B)
                out[n][t0 : t0 + chunk] = bufs[n]
            del bufs  # free the chunk's working buffers before the next one
    ro = Readout({n: b.permute(2, 0, 1) for n, b in out.items()}, parts[0].transpose(1, 2),
                 None if len(parts) == 1 else parts[1].transpose(1, 2), {"method": "step"})
    return assemble(fam, call, ro, keep, chunk=chunk, **own_meta(fam, own, ro))
