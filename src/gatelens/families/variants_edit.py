"""Interventions on the ONNX / Keras variant cells (VariantLSTM, VariantGRU;
families/variants.py): each direction stepped as the module steps it, the edit inside
the step at the edited positions.

At a step with no edit the module's own ``cell`` runs on its own input projection (the
module's ``run``, step for step: its output before the first edit is bitwise the
module's); at an edited position the variant's step equations (cells/variants.py) run with
the edit inside, so a gate edit reaches the state through them and a state edit is the
state the next step receives. ``carry=False`` runs that step twice: edited for what the
position puts out, unedited for the state handed on. A reverse direction steps from the
end, its positions still window positions. The trace at an unedited step is the anchored
read-out (every gate from the module's own state before the step) beside the module's
own state.

>>> import torch
>>> from gatelens.cells.variants import VariantGRU
>>> from gatelens.families.edit_plan import EditPlan, StepChange
>>> from gatelens.families.registry import family_of
>>> m = VariantGRU(3, 4, reset_after=False); x = torch.randn(2, 6, 3)
>>> fam = family_of(m); own = m(x)
>>> hold = StepChange("layer0", "z", frozenset(range(2, 6)), True,
...                   lambda t, v: torch.ones_like(v))
>>> (out, h_n), sig = intervene(fam, fam.check(x), EditPlan([hold]), own)
>>> torch.equal(out[:, :2], own[0][:, :2]), torch.equal(out[:, 5], out[:, 1])
(True, True)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gatelens.families.base import Call
from gatelens.families.edit_plan import EditPlan

__all__ = ["intervene"]


def _direction(fam: Any, d: int, reverse: bool, name: str, call: Call, plan: EditPlan,
               offset: int) -> tuple[list[Tensor], list[Tensor], dict[str, Tensor]]:
    """One direction: its state parts after every step (h, (c)) in window order, the
    final parts, and the signals by letter (B, T, H) when the plan wants them."""
    m, x, T = fam.module, call.inputs, call.length
    w = m.weights(d)
    xw = F.linear(x, w.w_ih, w.b_ih)  # (B, T, G): as the module's run projects its input
    letters = ("h", "c")[: fam.n_parts]
    parts = [p[d] for p in call.state]
    edited = set(plan.positions(name))
    seq: list[list[Tensor]] = [[] for _ in letters]
    rows: list[dict[str, Tensor]] = []
    order = range(T - 1, -1, -1) if reverse else range(T)
    for j in order:
        t = offset + j
        if t in edited:
            sig = fam._step(w, x[:, j], parts, plan.step_edit(name, t))
            handed = fam._step(w, x[:, j], parts, plan.step_edit(name, t, True)) \
                if plan.local(name, t) else sig
            shown, parts = [sig[s] for s in letters], [handed[s] for s in letters]
        else:
            prev = parts
            parts = m.cell(w, xw[:, j], parts)  # the module's own step
            shown = parts
            sig = ({**fam._step(w, x[:, j], prev), **dict(zip(letters, parts, strict=True))}
                   if plan.signals else {})
        for n, p in enumerate(shown):
            seq[n].append(p)
        rows.append(sig)
    if reverse:
        seq, rows = [s[::-1] for s in seq], rows[::-1]
    signals = ({s: torch.stack([r[s] for r in rows], dim=1) for s in fam.spec.signals}
               if plan.signals else {})
    return [torch.stack(s, dim=1) for s in seq], parts, signals


def intervene(fam: Any, call: Call, plan: EditPlan, output: Any, offset: int = 0
              ) -> tuple[Any, dict[str, Tensor]]:
    """The module's (output, final state) with ``plan``'s edits, as the module returns
    them, and every signal of the edited trajectory by trace name (B, T, ·)."""
    outs, finals, signals = [], [], {}
    with torch.set_grad_enabled(plan.grad):
        for d, reverse, name in fam.layers():
            seq, last, sig = _direction(fam, d, reverse, name, call, plan, offset)
            outs.append(seq[0])
            finals.append(last)
            signals.update({f"{name}.{s}": v for s, v in sig.items()})
    out = torch.cat(outs, dim=-1)  # (B, T, D·H)
    parts = [torch.stack([f[j] for f in finals]) for j in range(fam.n_parts)]  # (D, B, H)
    final = tuple(parts) if fam.n_parts == 2 else parts[0]
    return (out, final), ({n: signals[n] for n in fam.names()} if plan.signals else {})
