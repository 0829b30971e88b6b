"""Interventions on the official families whose hand cell takes an edit inside its step
(``step_cell(..., edit=)``: transformers' Mamba-1 and Mamba-2, mambapy).

Before the first edited position the module's own run is used unchanged: its output as
it returned it, bitwise, and its own decode-path state (``reference``). From there every
layer's hand cell steps with the module's own weights and dtype, the plan's edit inside
the step (a Δ or keep edit reaches the state through the cell's equations; a state edit
is the state that position's output reads and the next step starts from), each layer's
output y edited after the cell, the residual stream carried up the layers. ``carry=False``
runs the step twice: edited for what the position puts out, unedited for the state handed
on. The module's output is returned as the module returns it (a ModelOutput's
``last_hidden_state`` replaced).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gatelens.errors import GatelensError
from gatelens.families.base import Call
from gatelens.families.edit_plan import EditPlan
from gatelens.families.spec import layer_name

__all__ = ["intervene"]


def _as_returned(output: Any, hidden: Tensor) -> Any:
    """``hidden`` (B, T, H) in the form the module returned its output."""
    if isinstance(output, Tensor):
        return hidden
    if hasattr(output, "last_hidden_state"):
        return type(output)(**{**output, "last_hidden_state": hidden})
    if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
        return (hidden, *output[1:])
    raise GatelensError(f"cannot return an edited output in place of a "
                        f"{type(output).__name__}")


def _own(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else (
        output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])


def intervene(fam: Any, call: Call, plan: EditPlan, output: Any, offset: int = 0
              ) -> tuple[Any, dict[str, Tensor]]:
    """The module's output with ``plan``'s edits and every signal of the edited
    trajectory by trace name (B, T, ·)."""
    if plan.grad:
        raise GatelensError(f"attribution patching does not support the {fam.name} family "
                            "yet (its edited run has no gradient path); pass "
                            "attribution=False")
    if call.state is not None:
        raise GatelensError(f"{fam.name}: an edited run starts from the zero state (no "
                            "cache)")
    L, B, T = fam.num_layers, call.batch, call.length
    first = min((t for layer in plan.layers() for t in plan.positions(layer)),
                default=offset + T) - offset
    first = max(first, 0)
    was = fam.module.training
    fam.module.eval()
    try:
        with torch.no_grad():
            ref = fam.reference(call)  # the module's own run: its state after every step
            signals = {n: v.clone() for n, v in fam.read(call, ref).signals.items()}
        if output is None:  # the module's forward was not run (a sweep's lean run)
            own_output = getattr(fam, "own_output", None)
            if own_output is None:
                raise GatelensError(f"{fam.name}: an edited run needs the module's own output")
            output = own_output(call)
        m, dtype = fam.module, call.inputs.dtype
        parts = [[p[:, first - 1].to(dtype) for p in ref.extra["parts"][k]] if first > 0
                 else [i.to(dtype) for i in fam.initial_parts(k, B)] for k in range(L)]
        steps: list[Tensor] = []
        with torch.no_grad():
            for t in range(first, T):
                x = call.inputs[:, t]
                for k in range(L):
                    name, at = layer_name(k), offset + t
                    aux = ref.extra["aux"][k]
                    aux = None if aux is None else aux[:, t]
                    u = fam.pre(k, m, x)
                    edit: Callable = plan.step_edit(name, at)
                    sig, new, y = fam.step_cell(k, m, u, parts[k], aux, edit=edit)
                    if plan.local(name, at):  # this position only: the state goes on unedited
                        new = fam.step_cell(k, m, u, parts[k], aux,
                                            edit=plan.step_edit(name, at, True))[1]
                    y = edit("y", y)
                    sig = {**sig, fam.spec.state: fam.state_of(k, new), "y": y}
                    for letter in fam.spec.signals:
                        key = f"{name}.{letter}"
                        signals[key][:, t] = sig[letter].reshape(B, -1).to(signals[key].dtype)
                    parts[k] = new
                    x = fam.post(k, m, x, y)
                steps.append(fam.final(m, x))
    finally:
        fam.module.train(was)
    own = _own(output)
    hidden = own if not steps else torch.cat(
        [own[:, :first], torch.stack(steps, dim=1).to(own.dtype)], dim=1)
    return _as_returned(output, hidden), {n: signals[n] for n in fam.names()}
