"""Interventions on the official families whose hand cell takes an edit inside its step
(``step_cell(..., edit=)``: transformers' Mamba-1, Mamba-2 and RWKV-4, mambapy, Gated
DeltaNet, KDA, RG-LRU, xlstm's and transformers' xLSTM, mingru-pytorch, RWKV-7).

Before the first edited position the module's own run is used unchanged: its output as
it returned it, bitwise, and its own decode-path state (``reference``). From there every
layer's hand cell steps with the module's own weights and dtype, the plan's edit inside
the step (a gate or keep edit reaches the state through the cell's equations; a state
edit is the state that position's output reads and the next step starts from), each
layer's output y edited after the cell, the residual stream carried up the layers.
``carry=False`` runs the step twice: edited for what the position puts out, unedited for
the state handed on. The module's output is returned as the module returns it (a
ModelOutput's ``last_hidden_state`` replaced). ``plan.grad``: the steps run with autograd
on (attribution patching differentiates through them).

Two quantities a step reads besides its state come from the module's clean run unless
the family says they live in the edited run (``live_aux``): ``"stabiliser"`` (xLSTM's m,
the package's running maximum, which an edit of a gate moves: ``step_cell(..., prev=m)``
computes m' from the one before as the package does and returns it as ``sig["m"]``) and
``"first_value"`` (RWKV-7's v_first, layer 0's value at the same token: the edited run's).

The write ``ENTRY`` is one more letter a plan may edit (the return path cut patches it):
e_t = s_t − A_t(s_{t−1}), what the step adds to its kept state (Mamba's Δ B x̂, RWKV-4's
e^k (v, 1), the delta rule's β v kᵀ, sLSTM's (1 − κ) z), with A_t the step's own keep
(a factor per coordinate, or the spec's ``keep_operator``) after the plan's edits. An
edited entry gives s_t = A_t(s_{t−1}) + e'_t, before the plan's edit of s itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gatelens.errors import GatelensError
from gatelens.families.base import Call
from gatelens.families.edit_plan import ENTRY, EditPlan
from gatelens.families.mamba_edit import applies, layer_steps
from gatelens.families.prefill import Start, cut, start
from gatelens.families.spec import layer_name

__all__ = ["ENTRY", "clean_entry", "entry_at", "entry_cut", "intervene"]



def takes_edits(fam: Any) -> bool:
    """Whether ``fam``'s hand cell takes an edit inside its step (``step_cell(edit=)``)."""
    cell = getattr(fam, "step_cell", None)
    return cell is not None and "edit" in inspect.signature(cell).parameters


def entry_cut(fam: Any) -> tuple[str, ...] | None:
    """What the return path cut patches on an official family: every letter of a step
    but the carried state, the layer's output and what the family derives for display
    (``derived``), and the write ``ENTRY``; None when its step takes no edit or it has no
    keep gate."""
    if not takes_edits(fam) or fam.spec.keep_gate is None:
        return None
    skip = {fam.spec.state, fam.spec.output, "y", *getattr(fam, "derived", ())}
    letters = dict.fromkeys(x for k in range(fam.num_layers) for x in fam.letters(k)
                            if x not in skip)
    return (*letters, ENTRY)


def _kept(fam: Any, k: int, sig: Mapping[str, Tensor], s_prev: Tensor) -> Tensor:
    """A_t(s_{t−1}): layer k's keep of one step on the state before it, (N, S) rows; ``sig``
    that step's letters (N, ·): the spec's keep operator, or its keep gate per unit."""
    spec = fam.spec
    if spec.keep_operator is not None:
        return spec.keep_operator(sig, s_prev)
    keep = sig[spec.keep_gate]
    if keep.shape[-1] == s_prev.shape[-1]:
        return keep * s_prev
    return keep[:, fam.state_units(k).to(keep.device)] * s_prev


def clean_entry(fam: Any, trace: Mapping[str, Tensor], k: int) -> Tensor:
    """Layer k's write e_t = s_t − A_t(s_{t−1}) on a run's trace (keys ``layerK.*``, (B, T,
    ·) each; the state before position 0 is zero): (B, T, S), what Patch and the return
    path cut give the ``ENTRY`` letter."""
    name, spec = layer_name(k), fam.spec
    s = trace[f"{name}.{spec.state}"]
    B, T, S = s.shape
    prev = torch.cat([s.new_zeros(B, 1, S), s[:, :-1]], dim=1)
    sig = {x: trace[f"{name}.{x}"].reshape(B * T, -1) for x in fam.letters(k)
           if x not in (spec.state, "y")}
    return s - _kept(fam, k, sig, prev.reshape(B * T, S)).reshape(B, T, S)


def entry_at(fam: Any, trace: Mapping[str, Tensor], k: int, t: int) -> Tensor:
    """``clean_entry``'s write of layer k at position t alone, (B, S): what the return path
    cut patches step by step, so that no edited run holds every layer's writes (a 24-layer
    Mamba-2 at mamba2-130m's width: 2.4 GB a window)."""
    name, spec = layer_name(k), fam.spec
    s = trace[f"{name}.{spec.state}"]
    prev = s[:, t - 1] if t > 0 else torch.zeros_like(s[:, 0])
    sig = {x: trace[f"{name}.{x}"][:, t] for x in fam.letters(k) if x not in (spec.state, "y")}
    return s[:, t] - _kept(fam, k, sig, prev)


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


def _with_entry(fam: Any, k: int, edit: Callable, s_prev: Tensor, wants: bool) -> Callable:
    """``edit`` with the write ``ENTRY`` applied before the state's own edit (module
    docstring); the step's edited keep letters are kept as they pass."""
    if not wants:
        return edit
    seen: dict[str, Tensor] = {}

    def inner(letter: str, value: Tensor) -> Tensor:
        if letter == fam.spec.state:
            kept = _kept(fam, k, seen, s_prev)
            value = kept + edit(ENTRY, value - kept)
        out = edit(letter, value)
        seen[letter] = out
        return out

    return inner


def _first(plan: EditPlan, offset: int, T: int) -> int:
    """The call's first step with an edit (T: none)."""
    return max(min((t for layer in plan.layers() for t in plan.positions(layer)),
                   default=offset + T) - offset, 0)


def intervene(fam: Any, call: Call, plan: EditPlan, output: Any, offset: int = 0
              ) -> tuple[Any, dict[str, Tensor]]:
    """The module's output with ``plan``'s edits and every signal of the edited
    trajectory by trace name (B, T, ·); {} when ``plan.signals`` is False, and from the
    first edited position on only when ``plan.known`` (the caller reads those before).
    With ``plan.output`` False the output is None and no layer above the last one the
    plan keeps is run."""
    if call.state is not None:
        raise GatelensError(f"{fam.name}: an edited run starts from the zero state (no "
                            "cache)")
    derived = [f"{c.layer}.{c.letter}" for c in plan.changes
               if c.letter in getattr(fam, "derived", ())]
    if derived:
        raise GatelensError(f"{derived[0]} is the package's own bookkeeping and feeds no "
                            f"step of the recurrence: edit the gates or the state ({fam.name})")
    if output is None and plan.output and getattr(fam, "own_output", None) is None:
        raise GatelensError(f"{fam.name}: an edited run needs the module's own output")
    first, L, B = _first(plan, offset, call.length), fam.num_layers, call.batch
    was = fam.module.training
    fam.module.eval()
    try:
        with torch.no_grad():
            if plan.signals and not plan.known:  # every position read here, by the family
                ref = fam.reference(call)
                signals = {n: v.clone() for n, v in fam.read(call, ref).signals.items()
                           if plan.wants(n)}
            else:
                signals = {}
            # the module's own run before the first edit: its state there and its output
            begin = start(fam, call, first, output is None and plan.output) if first else \
                Start(None, [fam.initial_parts(k, B) for k in range(L)], [None] * L)
            if output is None and plan.output:
                output = begin.output if first else fam.own_output(cut(call, 1))
        run = layer_steps if applies(fam) else _steps  # the selective scan: layer by layer
        rows, steps = run(fam, call, plan, begin, first, offset)
    finally:
        fam.module.train(was)
    if not plan.output:  # the kept signals alone (EditPlan.output)
        return None, _merged(fam, call, signals, rows, first)
    own = _own(output)
    hidden = torch.cat([own[:, :first], steps.to(own.dtype)], dim=1) \
        if steps.shape[1] else own
    if not plan.signals:
        return _as_returned(output, hidden), {}
    return _as_returned(output, hidden), _merged(fam, call, signals, rows, first)


def _merged(fam: Any, call: Call, signals: dict[str, Tensor], rows: dict[str, Tensor],
            first: int) -> dict[str, Tensor]:
    """The edited run's signals by trace name in the family's order: the steps' ``rows``
    (B, T − first, W), after the unedited ``signals`` where the caller has none."""
    for name, got in rows.items():  # only the wanted
        if name in signals:
            signals[name][:, first:] = got.to(signals[name].dtype)
        else:
            signals[name] = got.to(fam.dtype_of(name.split(".")[-1], call.inputs.dtype))
    return {n: signals[n] for n in fam.names() if n in signals}


def _steps(fam: Any, call: Call, plan: EditPlan, begin: Start, first: int, offset: int
           ) -> tuple[dict[str, Tensor], Tensor]:
    """From ``first`` on, each layer's hand cell with the plan's edits inside, from the
    module's own state ``begin``: each signal the plan wants by trace name and the module's
    output, (B, T − first, ·) each, every step written into one tensor as it is made (a
    group of a 24-layer Mamba-2's states is held once, not as steps and then stacked, and
    the layers it does not want not at all)."""
    L, B, T = fam.num_layers, call.batch, call.length
    weights = getattr(fam, "edit_weights", None)
    m, dtype = (fam.module if weights is None else weights()), call.inputs.dtype
    parts = [fam.carried_parts(k, begin.parts[k], dtype) for k in range(L)]
    live = getattr(fam, "live_aux", None)
    stab = ([begin.aux[k].to(dtype) if first else fam.initial_stabiliser(k, B).to(dtype)
             for k in range(L)] if live == "stabiliser" else [])
    cut_entry = any(c.letter == ENTRY for c in plan.changes)
    rows: dict[str, Tensor] = {}
    steps: list[Tensor] = []
    wanted = {k: [g for g in fam.letters(k) if plan.wants(f"{layer_name(k)}.{g}")]
              for k in range(L)}
    top = plan.through(fam)
    with torch.set_grad_enabled(plan.grad):
        for t in range(first, T):
            x, v_first = call.inputs[:, t], None
            for k in range(top):  # no layer above the last one kept (EditPlan.output)
                name, at = layer_name(k), offset + t
                aux, kw = _aux(fam, live, t, B, x, v_first), {}
                if live == "stabiliser":
                    kw = {"prev": stab[k]}
                u = fam.pre(k, m, x)
                s_prev = fam.state_of(k, parts[k]) if cut_entry else None
                edit = _with_entry(fam, k, plan.step_edit(name, at), s_prev, cut_entry)
                sig, new, y = fam.step_cell(k, m, u, parts[k], aux, edit=edit, **kw)
                handed, shown = sig, new
                if plan.local(name, at):  # this position only: the state goes on unedited
                    again = _with_entry(fam, k, plan.step_edit(name, at, True), s_prev,
                                        cut_entry)
                    handed, new, _ = fam.step_cell(k, m, u, parts[k], aux, edit=again, **kw)
                if live == "stabiliser":
                    stab[k] = handed["m"]
                y = edit("y", y)
                if k == 0 and live == "first_value":
                    v_first = sig["v"]
                if wanted[k]:
                    sig = {**sig, fam.spec.state: fam.state_of(k, shown), "y": y}
                    for letter in wanted[k]:
                        v = sig[letter].reshape(B, -1)
                        if f"{name}.{letter}" not in rows:
                            rows[f"{name}.{letter}"] = v.new_empty(B, T - first, v.shape[1])
                        rows[f"{name}.{letter}"][:, t - first] = v
                parts[k] = new
                x = fam.post(k, m, x, y)
            if plan.output:
                steps.append(fam.final(m, x))
    return rows, (torch.stack(steps, dim=1) if steps else call.inputs[:, :0])


def _aux(fam: Any, live: str | None, t: int, B: int, x: Tensor, v_first: Tensor | None
         ) -> Tensor | None:
    """What step t of a layer reads besides its state (module docstring): RWKV-7's
    v_first (the edited run's), RG-LRU's reset (1 at position 0), else nothing."""
    if live == "first_value":
        return v_first
    if live == "reset":
        return x.new_full((B, 1), 1.0 if t == 0 else 0.0)
    return None
