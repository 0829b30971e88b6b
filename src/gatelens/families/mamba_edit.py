"""The edited run of the selective-scan (Mamba-1) cell layer by layer, as the module's own
forward runs it (families/official_edit.py steps every other family one position at a
time): transformers' Mamba, FalconMamba and Jamba's mixers, and mambapy.

From the first edited position on, each layer takes its whole input sequence at once: the
block's norm, in_proj, the causal convolution (its first taps from the state's buffer),
x_proj, Δ = softplus(dt_proj Δ̃), the keep a = exp(Δ A) and the write Δ B x̂ for every
position in one product each; only the recurrence s_t = a_t ⊙ s_{t−1} + Δ_t B_t x̂_t runs
position by position, and the read-out y = out_proj((C_t · s_t + D x̂_t) ⊙ silu(z_t)) is
again one product. An edit acts where the cell computes its letter (hf_mamba.py's
``step_cell``): Δ (the keep and the write follow it), the keep a, the write ``entry``, the
state s and the layer's output y; ``carry=False`` hands the next position the state of the
step with only the carried edits. The same equations as the step-by-step cell, in the
module's dtype, with the module's per-position rounding of its batched products: the
cost of the module's own forward on the steps from the first edit on, not of as many
single steps (~7× that for a 24-layer, 768-wide model on the CPU, BENCHMARKS.md).

>>> import torch
>>> from transformers import MambaConfig, MambaModel
>>> from gatelens.families.hf_mamba import HFMambaFamily
>>> from gatelens.families.edit_plan import EditPlan, StepChange
>>> cfg = MambaConfig(vocab_size=7, hidden_size=8, state_size=4, num_hidden_layers=2,
...                   expand=2, conv_kernel=3, time_step_rank=2)
>>> fam = HFMambaFamily(MambaModel(cfg).eval())
>>> applies(fam)
True
>>> call = fam.check(torch.randint(0, 7, (2, 9)))
>>> zero = StepChange("layer1", "s", frozenset({4}), True, lambda t, v: torch.zeros_like(v))
>>> out, sig = fam.intervene(call, EditPlan([zero]), None)
>>> bool((sig["layer1.s"][:, 4] == 0).all()), tuple(out.last_hidden_state.shape)
(True, (2, 9, 8))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gatelens.families.base import Call
from gatelens.families.edit_plan import ENTRY, EditPlan
from gatelens.families.spec import layer_name

__all__ = ["applies", "base", "layer_steps"]


def base(fam: Any, name: str) -> type | None:
    """The class ``families.hf_mamba.<name>`` among ``fam``'s bases (found by name: that
    file imports this one's importer when it runs an edit)."""
    return next((c for c in type(fam).__mro__ if c.__name__ == name
                 and c.__module__ == "gatelens.families.hf_mamba"), None)


def applies(fam: Any) -> bool:
    """Whether ``fam`` steps the selective-scan cell as families/hf_mamba.py writes it."""
    cell = base(fam, "MambaCell")
    return cell is not None and type(fam).step_cell is cell.step_cell


def _edits(plan: EditPlan, name: str, offset: int, first: int, T: int) -> dict[int, tuple]:
    """{step j (from ``first``): (the edit, the carried-only edit or None)} of a layer."""
    out = {}
    for t in plan.positions(name):
        j = t - offset - first
        if 0 <= j < T - first:
            local = plan.local(name, t)
            out[j] = (plan.step_edit(name, t), plan.step_edit(name, t, True) if local else None)
    return out


def _one(edit, dt: Tensor, A: Tensor, Bt: Tensor, xc: Tensor, s: Tensor, D: int, N: int
         ) -> tuple[Tensor, Tensor, Tensor]:
    """One edited step from its pre-activation Δ̃-part ``dt`` (R, Din): (Δ, a, s') with the
    edit inside, as ``MambaCell.step_cell`` applies it."""
    delta = edit("delta", F.softplus(dt))
    a = edit("a", torch.exp(delta[..., None] * A).reshape(-1, D * N)).view(-1, D, N)
    write = delta[..., None] * Bt[:, None, :] * xc[..., None]
    kept = a * s
    new = kept + edit(ENTRY, write.reshape(-1, D * N)).view(-1, D, N)
    return delta, a.reshape(-1, D * N), edit("s", new.reshape(-1, D * N)).view(-1, D, N)


def layer_steps(fam: Any, call: Call, plan: EditPlan, begin: Any, first: int, offset: int
                ) -> tuple[dict[str, Tensor], Tensor]:
    """``official_edit._steps`` for the selective-scan cell, layer by layer (module
    docstring): each wanted signal by trace name and the module's output, (B, T − first, ·)
    each."""
    m, dtype = fam.module, call.inputs.dtype
    B, T = call.batch, call.length
    Din, N, K = fam.d_inner, fam.d_state, fam.d_conv
    x = call.inputs[:, first:]  # (B, T', D): the block inputs from the first edit on
    rows: dict[str, Tensor] = {}
    with torch.set_grad_enabled(plan.grad):
        for k in range(plan.through(fam)):  # no layer above the last one kept (EditPlan.output)
            name, mix = layer_name(k), fam.mixers(m)[k]
            buf, s = (p.to(dtype) for p in begin.parts[k])
            u = fam.pre(k, m, x)
            xi, z = mix.in_proj(u).chunk(2, dim=-1)  # (B, T', Din) each
            full = torch.cat([buf.view(B, K - 1, Din), xi], dim=1)  # (B, T' + K − 1, Din)
            xc = sum(full[:, j : j + xi.shape[1]] * mix.conv1d.weight[:, 0, j] for j in range(K))
            if mix.conv1d.bias is not None:
                xc = xc + mix.conv1d.bias
            xc = fam._act(mix, xc)
            rank = mix.dt_proj.weight.shape[1]
            dt, Bm, Cm = torch.split(mix.x_proj(xc), [rank, N, N], dim=-1)
            dt, Bm, Cm = fam._bcdt(mix, dt, Bm, Cm)
            dt = dt @ mix.dt_proj.weight.T + mix.dt_proj.bias  # (B, T', Din)
            A = -torch.exp(mix.A_log.float()).to(dtype)  # (Din, N), as step_cell takes it
            delta = F.softplus(dt)
            a = torch.exp(delta[..., None] * A)  # (B, T', Din, N)
            write = delta[..., None] * Bm[:, :, None, :] * xc[..., None]
            edits = _edits(plan, name, offset, first, T)
            s = s.view(B, Din, N)
            shown, deltas, keeps = [], [], []
            for j in range(xi.shape[1]):
                if j not in edits:
                    s = a[:, j] * s + write[:, j]
                    shown.append(s)
                    continue
                edit, carried = edits[j]
                dj, aj, new = _one(edit, dt[:, j], A, Bm[:, j], xc[:, j], s, Din, N)
                deltas.append((j, dj))
                keeps.append((j, aj))
                shown.append(new)
                s = new if carried is None else _one(carried, dt[:, j], A, Bm[:, j], xc[:, j],
                                                     s, Din, N)[2]
            states = torch.stack(shown, dim=1)  # (B, T', Din, N)
            y = (states @ Cm[..., None])[..., 0] + mix.D * xc
            y = mix.out_proj(y * F.silu(z))  # (B, T', D)
            if edits:
                y = torch.stack([edits[j][0]("y", y[:, j]) if j in edits else y[:, j]
                                 for j in range(y.shape[1])], dim=1)
            if plan.wants(f"{name}.delta"):
                delta = delta.clone()
                for j, v in deltas:
                    delta[:, j] = v
                rows[f"{name}.delta"] = delta
            if plan.wants(f"{name}.a"):
                a = a.reshape(B, -1, Din * N).clone()
                for j, v in keeps:
                    a[:, j] = v
                rows[f"{name}.a"] = a
            for letter, v in (("s", states.reshape(B, -1, Din * N)), ("y", y)):
                if plan.wants(f"{name}.{letter}"):
                    rows[f"{name}.{letter}"] = v
            x = fam.post(k, m, x, y)
        out = fam.final(m, x) if plan.output else x[:, :0]
    return rows, out
