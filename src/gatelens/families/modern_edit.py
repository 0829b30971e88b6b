"""Interventions on gatelens's own cells (cells/modern.py), layer by layer.

Each layer runs its own ``layer`` (the module's forward, sequential or the scan as the
module's forward takes it) over every stretch of steps with no edit, from the state the
stretch starts in, and the same ``layer`` on one step with the edit inside at an edited
position (a gate edit reaches the state through the cell's equations). ``carry=False`` is
the step run twice: edited for what the position puts out, unedited for the state handed
on. The block's output y (the next layer's input) is edited after the block. The layer
above reads the edited y; the module's output before the first edited step is its own,
bitwise.

>>> import torch
>>> from gatelens.cells.modern import MinGRU
>>> from gatelens.families.registry import family_of
>>> from gatelens.families.edit_plan import EditPlan, StepChange
>>> m = MinGRU(3, 4); x = torch.randn(2, 6, 3); fam = family_of(m); own = m(x)
>>> hold = StepChange("layer0", "keep", frozenset(range(2, 6)), True,
...                   lambda t, v: torch.ones_like(v))
>>> write = StepChange("layer0", "z", frozenset(range(2, 6)), True,
...                    lambda t, v: torch.zeros_like(v))
>>> (out, h_n), sig = intervene(fam, fam.check(x), EditPlan([hold, write]), own)
>>> h = sig["layer0.h"]; torch.equal(h[:, 1:], h[:, 1:2].expand(2, 5, 4))
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gatelens.errors import GatelensError
from gatelens.families.base import Call
from gatelens.families.edit_plan import EditPlan
from gatelens.families.spec import layer_name


def _wrap(edit: Any) -> Any:
    """A plan's step edit ((B, W) values) for a layer run on one step: its values are
    (B, 1, H) (minGRU, minLSTM) or (B, H) (sLSTM's own loop)."""
    def inner(letter: str, value: Tensor) -> Tensor:
        if value.ndim == 3:
            return edit(letter, value[:, 0]).unsqueeze(1)
        return edit(letter, value)

    return inner


def intervene(fam: Any, call: Call, plan: EditPlan, output: Any, offset: int = 0
              ) -> tuple[Any, dict[str, Tensor]]:
    """The module's (y, final state) with ``plan``'s edits and every signal of the edited
    trajectory by trace name (B, T, ·)."""
    m = fam.module
    bad = [f"{c.layer}.{c.letter}" for c in plan.changes if c.letter in m.derived]
    if bad:
        raise GatelensError(f"{bad[0]} is derived from the other signals and feeds none of "
                            f"them: edit the gates or the state ({fam.name})")
    mode = m.scan_mode
    parallel = mode == "parallel" or (mode == "auto" and call.inputs.is_cuda)
    x, T = call.inputs, call.length
    init = m._states(call.state, x)
    below, finals, signals = None, [], {}
    with torch.set_grad_enabled(plan.grad):
        for k in range(fam.num_layers):
            name = layer_name(k)
            inp = x if k == 0 else m.norm_in[k - 1](below)  # (B, T, F_k)
            edited = set(plan.positions(name))
            hand = [j for j in range(T) if offset + j in edited]
            state, parts, j = init[k], [], 0
            for n in [*hand, T]:
                if n > j:
                    sig, state = m.layer(k, inp[:, j:n], state, parallel)
                    parts.append(sig)
                if n < T:
                    t = offset + n
                    step = inp[:, n : n + 1]
                    sig, out = m.layer(k, step, state, False, _wrap(plan.step_edit(name, t)))
                    if plan.local(name, t):
                        out = m.layer(k, step, state, False,
                                      _wrap(plan.step_edit(name, t, True)))[1]
                    state = out
                    parts.append(sig)
                j = n + 1
            lay = {s: torch.cat([p[s] for p in parts], dim=1) for s in parts[0]}
            y = m.block(k, lay["h"], below)  # (B, T, H)
            for n in hand:  # the block's output, edited after the block
                y[:, n] = plan.step_edit(name, offset + n)("y", y[:, n])
            lay["y"], below = y, y
            finals.append(state)
            signals.update({f"{name}.{s}": v for s, v in lay.items()})
        first = min((t for layer in plan.layers() for t in plan.positions(layer)),
                    default=offset + T) - offset
        if output is not None and first > 0:
            below = torch.cat([output[0][:, :first].to(below.dtype), below[:, first:]], dim=1)
    return (below, m._pack(finals)), {n: signals[n] for n in fam.names()}
