"""Interventions on nn.LSTM, nn.GRU and nn.RNN (and the cells, their one-layer modules).

Layer by layer, each direction on its own: the layer's own PyTorch kernel (a one-layer,
one-direction module holding that layer's tensors, shared) runs every stretch of steps
with no edit, from the state the stretch starts in; at an edited position the cell's own
equations (cells/equations.py) run one step with the edit inside it, so a gate edit
changes that step's state, and a state edit is the state the next step receives. A
"this position only" edit (carry=False) is the step run twice: edited for what position
t puts out (the layer above, the module's output), unedited for the state handed on. A
reverse direction is the same on the time-flipped sequence. The layer above reads the
edited layer's output, so an edit carries up the stack and, through the module's output,
into the rest of the model. The module's output before the first edited step is its own,
bitwise (the forward's output, spliced in).

>>> import torch
>>> from gatelens.families.registry import family_of
>>> from gatelens.families.edit_plan import EditPlan, StepChange
>>> lstm = torch.nn.LSTM(3, 4, batch_first=True); x = torch.randn(2, 6, 3)
>>> fam = family_of(lstm); call = fam.check(x); own = lstm(x)
>>> zero = StepChange("layer0", "c", frozenset({3}), True, lambda t, v: torch.zeros_like(v))
>>> (out, (h_n, c_n)), sig = intervene(fam, call, EditPlan([zero]), own)
>>> torch.equal(out[:, :3], own[0][:, :3]), bool((sig["layer0.c"][:, 3] == 0).all())
(True, True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gatelens.cells.equations import cell_weights, step
from gatelens.cells.numerics import quiet_onednn
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Reference
from gatelens.families.edit_plan import EditPlan
from gatelens.families.spec import layer_name
from gatelens.families.torch_ops import like


def direction_module(fam: Any, k: int, reverse: bool) -> nn.RNNBase:
    """A one-layer, one-direction, batch-first module of layer ``k``'s tensors (cached)."""
    cache = fam.__dict__.setdefault("_directions", {})
    if (k, reverse) not in cache:
        sfx = f"_l{k}{'_reverse' if reverse else ''}"
        tensors = {n.replace(sfx, "_l0"): p.detach() for n, p in fam.module.named_parameters()
                   if n.endswith(sfx)}
        cache[k, reverse] = like(fam.module, 1, tensors, bidirectional=False,
                                 input_size=tensors["weight_ih_l0"].shape[1])
    return cache[k, reverse]


def _kernel(mod: nn.RNNBase, x: Tensor, state: tuple[Tensor, ...]
            ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The layer's kernel on x (B, τ, F) from ``state`` ((1, B, ·) parts): (y, final parts),
    in calls of power-of-two lengths, the state handed from one to the next. oneDNN
    builds a primitive per sequence length the first time it meets it (~300 ms on the
    CPU, ~16 runs of the seed's LSTM): a sweep's stretches, of every length, would build one
    per position; its result at each step does not depend on the call's length (the
    same bits on the tests' CPU)."""
    ys, n, j = [], x.shape[1], 0
    with quiet_onednn():
        for size in (1 << b for b in range(n.bit_length() - 1, -1, -1)):
            if n - j >= size:
                y, fin = mod.forward(x[:, j : j + size], state if len(state) == 2 else state[0])
                state = fin if isinstance(fin, tuple) else (fin,)
                ys.append(y)
                j += size
    return (ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)), state


def _segment(fam1: Any, mod: nn.RNNBase, x: Tensor, state: tuple[Tensor, ...],
             read: bool = True) -> tuple[Tensor, tuple[Tensor, ...], dict[str, Tensor]]:
    """The layer's own kernel on steps ``x`` (B, τ, F) from ``state`` ((B, ·) parts): its
    output (B, τ, H_out), the state after the last step and the read-out of every signal
    (``read`` False: none, {})."""
    given = tuple(s.unsqueeze(0) for s in state)
    y, fin = _kernel(mod, x, given)
    if not read:
        return y, tuple(f[0] for f in fin), {}
    call = Call(x, given, {"batch_first": True, "unbatched": False, "packed": None,
                           "lengths": None})
    ref = Reference({"layer0.h": y}, {"layer0": x}, {"layer0": state})
    sig = dict(fam1.read(call, ref).signals)
    if "layer0.c" in sig:  # the c the next step reads is the kernel's own: shown as it is
        sig["layer0.c"] = torch.cat([sig["layer0.c"][:, :-1], fin[1][0].unsqueeze(1)], dim=1)
    return y, tuple(f[0] for f in fin), sig


def _layer(fam: Any, k: int, reverse: bool, x: Tensor, state: tuple[Tensor, ...],
           plan: EditPlan, offset: int) -> tuple[Tensor, tuple[Tensor, ...], dict[str, Tensor]]:
    """One layer and direction on its input ``x`` (B, T, F), batch first in window order:
    its output (B, T, H_out), final state parts and signals by letter (B, T, ·)."""
    name, T = layer_name(k, reverse), x.shape[1]
    mod = direction_module(fam, k, reverse)
    fam1 = type(fam)(mod)
    w = cell_weights(fam.module, k, reverse)
    if reverse:
        x = x.flip(1)

    def pos(j: int) -> int:  # the window position of processing step j
        return offset + (T - 1 - j if reverse else j)

    edited = set(plan.positions(name))
    hand = [j for j in range(T) if pos(j) in edited]
    ys: list[Tensor] = []
    sigs: list[dict[str, Tensor]] = []
    j = 0
    if plan.start is not None and not reverse and hand and hand[0] > 0:
        # the unedited run's own prefix (a sweep's): its output and its state before the edit
        j, given = hand[0], {s.rpartition(".")[2]: v for s, v in plan.start.items()
                             if s.rpartition(".")[0] == name}
        ys.append(given["h"][:, :j].to(x.dtype))
        state = tuple(given[s][:, j - 1].to(x.dtype) for s in ("h", "c") if s in given)
        if plan.signals:
            sigs.append({s: v[:, :j] for s, v in given.items()})
    for n in [*hand, T]:
        if n > j:
            y, state, sig = _segment(fam1, mod, x[:, j:n], state, plan.signals)
            ys.append(y)
            if plan.signals:
                sigs.append({s.split(".")[-1]: v for s, v in sig.items()})
        if n < T:
            t = pos(n)
            sig = step(w, x[:, n], *state, edit=plan.step_edit(name, t))
            carried = step(w, x[:, n], *state, edit=plan.step_edit(name, t, True)) \
                if plan.local(name, t) else sig
            state = (carried["h"], carried["c"]) if "c" in carried else (carried["h"],)
            ys.append(sig["h"].unsqueeze(1))
            if plan.signals:
                sigs.append({s: v.unsqueeze(1) for s, v in sig.items()})
        j = n + 1
    y = torch.cat(ys, dim=1)
    sig = {s: torch.cat([p[s] for p in sigs], dim=1) for s in sigs[0]} if sigs else {}
    if reverse:
        y, sig = y.flip(1), {s: v.flip(1) for s, v in sig.items()}
    return y, state, sig


def intervene(fam: Any, call: Call, plan: EditPlan, output: Any, offset: int = 0
              ) -> tuple[Any, dict[str, Tensor]]:
    """The module's output with ``plan``'s edits, as the module returns it (its layout),
    and every signal of the edited trajectory by trace name, (B, T, ·). ``output`` is what
    the module itself returned on the call (its prefix before the first edit is kept);
    ``offset`` the window position of the call's first step (a call of one step in a
    loop)."""
    if call.layout.get("packed") is not None:
        raise GatelensError(f"{type(fam.module).__name__}: edits on a PackedSequence input "
                            "are not supported; pass the padded tensor")
    L, D = fam.num_layers, fam.directions
    x, finals, signals = call.inputs, {}, {}
    first = min((t for layer in plan.layers() for t in plan.positions(layer)),
                default=offset + call.length) - offset
    with torch.set_grad_enabled(plan.grad):
        for k in range(L):
            outs = []
            for d in range(D):
                row = k * D + d
                y, fin, sig = _layer(fam, k, bool(d), x, tuple(s[row] for s in call.state),
                                     plan, offset)
                outs.append(y)
                finals[row] = fin
                signals.update({f"{layer_name(k, bool(d))}.{s}": v for s, v in sig.items()})
            x = torch.cat(outs, dim=-1)  # (B, T, D·H_out): the layer above reads this
        own = None if output is None else output[0]
        if D == 1 and first > 0 and isinstance(own, Tensor):
            own = own.unsqueeze(0) if call.layout.get("unbatched") else (
                own if fam.module.batch_first else own.transpose(0, 1))
            x = torch.cat([own[:, :first].to(x.dtype), x[:, first:]], dim=1)
    parts = tuple(torch.stack([finals[r][j] for r in range(L * D)])
                  for j in range(len(finals[0])))  # (L·D, B, ·) each
    if call.layout.get("unbatched"):  # (T, H_out) and (L·D, H_out)
        out, parts = x[0], tuple(p[:, 0] for p in parts)
    else:
        out = x if fam.module.batch_first else x.transpose(0, 1)
    sig = {n: signals[n] for n in fam.names()} if plan.signals else {}
    return (out, parts if len(parts) == 2 else parts[0]), sig
