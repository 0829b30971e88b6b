"""A recorded trajectory: the calls of one module in one forward, stitched into one sequence.

A model that steps an nn.LSTMCell in a Python loop, or calls an nn.LSTM / nn.GRU / nn.RNN
once per output step with its own state handed back, runs one trajectory as many calls.
``gatelens.readout.stitch`` groups the calls into trajectories; each is a ``Recorded``: the
step inputs side by side (B, T, F), the state the first call was given, and every state
the module itself returned, after every step, for every layer. Those returned states ARE
the module's own trajectory, so the family's reference is built from them and nothing is
re-run: the one-step check compares the hand cell with what the module's own calls gave.

``recorded_call`` and ``recorded_reference`` serve every torch family (nn.LSTM, nn.GRU,
nn.RNN and the cells, which are opened as one-layer modules of the same tensors).

>>> import torch
>>> from gatelens.families.registry import family_of
>>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
>>> x, state, hs, cs = torch.randn(2, 5, 3), None, [], []
>>> for t in range(5):  # a decoder called one step at a time
...     _, state = lstm(x[:, t : t + 1], state)
...     hs.append(state[0]); cs.append(state[1])
>>> rec = Recorded(x, None, (torch.stack(hs, 2), torch.stack(cs, 2)), calls=5)
>>> fam = family_of(lstm); call = fam.check(rec); ref = fam.reference(call)
>>> tuple(ref.states["layer0.c"].shape), fam.one_step(call, ref)[0].max_abs_diff_h < 1e-6
((2, 5, 4), True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gatelens.families.base import Call, Readout, Reference
from gatelens.families.records import nan_max
from gatelens.families.spec import layer_name


@dataclass
class Recorded:
    """One trajectory of a module stitched from its calls in one forward.

    ``inputs``: every step's input, batch first (B, T, F). ``state``: the initial state the
    first call was given, as parts (h[, c]) of shape (L, B, ·), or None (zeros).
    ``steps``: the parts the module returned after each step, (L, B, T, ·) each: every
    layer's h (and the LSTM's c) as the module's own calls computed them. ``calls``: how
    many calls made it; ``first``: the index of its first call among the module's calls
    in the forward; ``why``: why it started (the first call, a state of None, a state that
    is not the previous call's output, a change of batch size).
    """

    inputs: Tensor  # (B, T, F)
    state: tuple[Tensor, ...] | None  # (L, B, ·) each, or None: zeros
    steps: tuple[Tensor, ...]  # (L, B, T, ·) each: h[, c] after every step
    calls: int = 1
    first: int = 0
    why: str = "the first call"
    unbatched: bool = False

    @property
    def batch(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def length(self) -> int:
        return int(self.inputs.shape[1])


def _sizes(fam: Any) -> list[int]:
    """The widths of the state parts: h (H_out), and c (H) for the LSTM."""
    out = getattr(fam, "output_size", fam.hidden_size)
    return [out, fam.hidden_size] if fam.two_states else [out]


def recorded_call(fam: Any, rec: Recorded) -> Call:
    """A recorded trajectory checked against ``fam``'s module (a one-direction torch
    family: ``num_layers``, ``hidden_size``, ``output_size``, ``two_states``), as a Call
    whose layout carries the recording; ValueError/TypeError naming what does not fit."""
    m = fam.module
    if getattr(fam, "bidirectional", False):
        raise ValueError(f"a bidirectional {type(m).__name__} called one step at a time has no "
                         "trajectory to stitch (its reverse direction runs inside each call)")
    w = m.weight_ih_l0
    x = rec.inputs
    if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != m.input_size:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"recorded inputs must be (B, T, {m.input_size}); got {shape}")
    if x.dtype != w.dtype or x.device != w.device:
        raise TypeError(f"recorded inputs must have the module's dtype {w.dtype} on "
                        f"{w.device}; got {x.dtype} on {x.device}")
    B, T, L = x.shape[0], x.shape[1], fam.num_layers
    sizes = _sizes(fam)
    if len(rec.steps) != len(sizes):
        raise ValueError(f"a recorded {type(m).__name__} keeps {len(sizes)} state parts a "
                         f"step; got {len(rec.steps)}")
    for part, size in zip(rec.steps, sizes, strict=True):
        if tuple(part.shape) != (L, B, T, size):
            raise ValueError(f"recorded states must be {(L, B, T, size)} (layers, batch, "
                             f"steps, units); got {tuple(part.shape)}")
    if rec.state is None:
        state = tuple(w.new_zeros(L, B, size) for size in sizes)
    else:
        state = tuple(rec.state)
        for part, size in zip(state, sizes, strict=True):
            if tuple(part.shape) != (L, B, size):
                raise ValueError(f"a recorded initial state must be {(L, B, size)}; got "
                                 f"{tuple(part.shape)}")
    layout = {"batch_first": True, "unbatched": rec.unbatched, "packed": None,
              "lengths": None, "recorded": rec}
    return Call(x, state, layout)


def recorded_reference(fam: Any, call: Call) -> Reference:
    """The module's own trajectory, read from its recorded calls (nothing is re-run): every
    layer's h (and c) after every step, each layer's input (the layer below's h), the
    initial states, the top layer's output and the final state."""
    rec: Recorded = call.layout["recorded"]
    L = fam.num_layers
    states: dict[str, Tensor] = {}
    for k in range(L):
        for part, values in zip(fam.state_parts, rec.steps, strict=True):
            states[f"{layer_name(k)}.{part}"] = values[k]  # (B, T, ·)
    inputs = {"layer0": call.inputs}
    for k in range(1, L):
        inputs[layer_name(k)] = states[f"{layer_name(k - 1)}.h"]  # (B, T, H_out)
    initial = {layer_name(k): tuple(s[k] for s in call.state) for k in range(L)}
    final = tuple(p[:, :, -1] for p in rec.steps)  # (L, B, ·) each
    ref = Reference(states, inputs, initial, states[f"{layer_name(L - 1)}.h"],
                    final if len(final) > 1 else final[0])
    # the LSTM's c is already the module's own (every step returned it): nothing to re-run
    ref.extra["stepped_c"] = True
    ref.extra["recorded_calls"] = rec.calls
    return ref


def recorded_output_diff(fam: Any, readout: Readout, call: Call) -> float:
    """max |read-out − what the module's calls returned| over every layer's h and c at every
    step: ``open_cells``'s free check for a stitched trajectory.

    The anchored read-out's h is the module's own, so this is the read-out's c (the LSTM's
    contraction) against the c the calls returned; 0 for the GRU and the RNN.
    """
    rec: Recorded = call.layout["recorded"]
    diff = 0.0
    for k in range(fam.num_layers):
        for part, values in zip(fam.state_parts, rec.steps, strict=True):
            mine = readout.signals[f"{layer_name(k)}.{part}"]
            diff = nan_max(diff, float((mine.double() - values[k].double()).abs().max()))
    return diff


def stack_steps(parts: list[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """Per-step parts ((L, B, ·) each, one tuple a step) side by side: (L, B, T, ·) each.

    >>> [tuple(p.shape) for p in stack_steps([(torch.zeros(1, 2, 3),)] * 4)]
    [(1, 2, 4, 3)]
    """
    return tuple(torch.stack([p[j] for p in parts], dim=2) for j in range(len(parts[0])))


@dataclass
class Step:
    """One call of one step, as a stitcher records it (``Family.step_of``).

    Attributes:
        x: the step's input (B, F).
        given: the state the call received as (L, B, ·) parts, None when it had none.
        out: the state the call returned as (L, B, ·) parts.
        returned: the returned state's own tensors (to tell the next call handed them back).
        received: the received state's own tensors (None when none).
        unbatched: whether the call was unbatched.
    """

    x: Tensor
    given: tuple[Tensor, ...] | None
    out: tuple[Tensor, ...]
    returned: tuple[Tensor, ...]
    received: tuple[Tensor, ...] | None
    unbatched: bool


def as_parts(value: Any, cell: bool, unbatched: bool) -> tuple[Tensor, ...]:
    """A state (h, or (h, c)) as (L, B, ·) parts: a cell's (B, H) gets L = 1, an unbatched
    one (H,) or (L, H) gets B = 1."""
    parts = value if isinstance(value, tuple) else (value,)
    out = []
    for p in parts:
        if cell:
            p = p.reshape(1, 1, -1) if unbatched else p.unsqueeze(0)
        elif unbatched:
            p = p.unsqueeze(1)
        out.append(p)
    return tuple(out)


def torch_step(inputs: Tensor, state: Any, output: Any, *, cell: bool,
               batch_first: bool = False) -> Step:
    """A ``Step`` of a PyTorch cell call (``cell``) or a one-step nn.LSTM/GRU/RNN call."""
    unbatched = inputs.ndim == (1 if cell else 2)
    if cell:
        x = inputs.reshape(1, -1) if unbatched else inputs  # (B, F)
    else:
        x = inputs if unbatched else (inputs[:, 0] if batch_first else inputs[0])
    returned = output if cell else output[1]
    raw = returned if isinstance(returned, tuple) else (returned,)
    given = None if state is None else as_parts(state, cell, unbatched)
    received = None if state is None else (state if isinstance(state, tuple) else (state,))
    return Step(x, given, as_parts(returned, cell, unbatched), raw, received, unbatched)
