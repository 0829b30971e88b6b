"""The divergence rate's tangent through a whole Mamba-1 stack, a layer at a time over the
whole window (``Dynamics.sweep``), instead of through the stack's step a token at a time.

A selective scan's state enters its own layer's step only linearly, s_t = a_t ⊙ s_{t−1} +
b_t, with a_t and b_t made from the layer's input alone (its convolution buffer holds
inputs, not states). So a tangent carried along the window obeys a recurrence of the same
kind,

    δs_t = a_t ⊙ δs_{t−1} + (δb_t + δa_t ⊙ s_{t−1}),

whose input side (δa_t, δb_t: ``torch.func.jvp`` of the layer's input side at the tangent of
its input, δu_t) is computed for every t at once, and whose recurrence is the fast scan
(forward_scan.linear_scan). The layer's output tangent δy_t (the jvp of its read-out at s_t
and δs_t) is the next layer's input tangent through the block's residual and norm. So the
stack is walked once, a layer at a time, and the tangent's norm after every step (every
layer's buffer and state side by side, the carried state's layout) gives each step's
growth: the step-by-step JVP renormalises after each step, which only rescales a linear
map's image, so the growths are the same in exact arithmetic.

Every family that steps as MambaCell does has it (transformers' Mamba and FalconMamba,
mambapy, Jamba's mixers; ``sweep`` returns None for any other). Mamba-2 is stepped: its
state is so much wider than its input that a whole window's state tangents formed through
its step cost more than the steps (a generic version was tried: 4.8 s against 3.1 s a
window at 2 layers of mamba2-130m's width).

The primal point is the module's own trajectory: each layer's input and states as the
module computed them (the step-by-step JVP evaluates each layer above the first at the hand
cell's one-step output, which differs from the module's by float32 rounding): λ agrees
with the step-by-step figure to ~1e-7 relative (tests/test_mamba_sweep.py). A window whose
tangent underflows or overflows before its end (|λ| above ~5 nats a token) is left to the
step-by-step JVP (``run`` returns None).

>>> import torch, transformers as tf
>>> from dataclasses import replace
>>> from gatelens.analysis.divergence import rate_of
>>> from gatelens.families.registry import open_family
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<...>
>>> m = tf.MambaModel(tf.MambaConfig(vocab_size=8, hidden_size=8, num_hidden_layers=2,
...                                  state_size=4, expand=2, use_cache=False)).eval()
>>> fam = open_family(m)
>>> call = fam.check(torch.randn(2, 24, 8))
>>> (dyn,) = fam.dynamics(call, fam.reference(call))
>>> dyn.sweep(torch.nn.functional.normalize(torch.randn(2, dyn.size), dim=-1)).shape
torch.Size([2, 24])
>>> swept, stepped = rate_of([dyn], burn_in=4), rate_of([replace(dyn, sweep=None)], burn_in=4)
>>> abs(swept.lyapunov_per_char - stepped.lyapunov_per_char) < 1e-6
True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gatelens.cells.names import layer_name
from gatelens.families.base import Call, Reference
from gatelens.families.forward_scan import linear_scan

__all__ = ["sweep"]


def sweep(fam: Any, call: Call, ref: Reference, cell: type
          ) -> Callable[[Tensor], Tensor | None] | None:
    """``Dynamics.sweep`` of a Mamba-1 stack on ``call``: (B, S) unit start tangents ->
    (B, T) ln of each step's growth, or None where a window's tangent left float64's range;
    None where ``fam`` does not step as ``cell`` (MambaCell) does, or reads more than its
    layer inputs (it is then stepped token by token)."""
    if type(fam).step_cell is not cell.step_cell or fam.uses_aux:
        return None

    def run(v: Tensor) -> Tensor | None:
        m = fam.float64()
        B, T = call.batch, call.length
        K, Din, N = fam.d_conv, fam.d_inner, fam.d_state
        sizes = [n for k in range(fam.num_layers) for n in ((K - 1) * Din, Din * N)]
        starts = v.to(torch.float64).split(sizes, dim=-1)
        sq = v.new_zeros(B, T, dtype=torch.float64)  # ‖v_t‖², every layer side by side
        dx = None  # the block input's tangent (layer 0 reads the fixed input)
        with torch.no_grad(), warnings.catch_warnings():
            # forward AD's decompositions warn, when first loaded, that torch.jit is deprecated
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                    category=DeprecationWarning)
            for k in range(fam.num_layers):
                x = ref.extra["x"][k].double()
                du = torch.zeros_like(x) if dx is None else \
                    torch.func.jvp(lambda x, k=k: fam.pre(k, m, x), (x,), (dx,))[1]
                dy, layer_sq = _layer(fam, m, k, ref, du, starts[2 * k], starts[2 * k + 1])
                sq += layer_sq
                y = ref.states[f"{layer_name(k)}.y"].double()
                dx = torch.func.jvp(lambda x, y, k=k: fam.post(k, m, x, y), (x, y),
                                    (torch.zeros_like(x) if dx is None else dx, dy))[1]
        if not bool(torch.isfinite(sq).all()) or not bool((sq > 0).all()):
            return None
        logs = 0.5 * torch.log(sq)
        return torch.cat([logs[:, :1], logs[:, 1:] - logs[:, :-1]], dim=1)

    return run


def _layer(fam: Any, m: Any, k: int, ref: Reference, du: Tensor, dbuf0: Tensor, ds0: Tensor
           ) -> tuple[Tensor, Tensor]:
    """Layer k's output tangent (B, T, F) and its share of ‖v_t‖² (B, T), from its input's
    tangent ``du`` and its start tangents (buffer, state)."""
    mix = fam.mixers(m)[k]
    K, Din, N = fam.d_conv, fam.d_inner, fam.d_state
    u = ref.inputs[layer_name(k)].double()
    Bn, T = u.shape[:2]
    xz, dxz = torch.func.jvp(mix.in_proj, (u,), (du,))
    (x, z), (dx, dz) = xz.chunk(2, dim=-1), dxz.chunk(2, dim=-1)
    buf0 = ref.initial[layer_name(k)][0].double().view(Bn, K - 1, Din)
    x_ext = torch.cat([buf0, x], dim=1)  # (B, T + K − 1, Din): the buffer, then the window
    dx_ext = torch.cat([dbuf0.view(Bn, K - 1, Din), dx], dim=1)
    A = -torch.exp(mix.A_log.float()).to(torch.float64)

    def inside(x_ext: Tensor) -> tuple[Tensor, ...]:  # MambaCell.step_cell's input side
        window = x_ext.unfold(1, K, 1).permute(0, 1, 3, 2).reshape(Bn * T, K, Din)
        xc, delta, B, C = fam._selective(mix, window)
        a = torch.exp(delta[..., None] * A)
        return a, delta[..., None] * B[:, None, :] * xc[..., None], xc, C

    (a, _, xc, C), (da, db, dxc, dC) = torch.func.jvp(inside, (x_ext,), (dx_ext,))
    s = ref.extra["parts"][k][1].double().view(Bn, T, Din, N)
    s_prev = torch.cat([ref.initial[layer_name(k)][1].double().view(Bn, 1, Din, N),
                        s[:, :-1]], dim=1)
    a = a.view(Bn, T, Din, N)
    drive = db.view(Bn, T, Din, N) + da.view(Bn, T, Din, N) * s_prev
    drive[:, 0] += a[:, 0] * ds0.view(Bn, Din, N)  # the start tangent, carried by step 0
    ds = linear_scan(a.transpose(0, 1), drive.transpose(0, 1), overwrite=True)  # (T, B, ·)
    ds = ds.transpose(0, 1)  # (B, T, Din, N)

    def out(s: Tensor, xc: Tensor, C: Tensor, z: Tensor) -> Tensor:  # MambaCell's read-out
        return fam.readout(mix, s.reshape(Bn * T, Din, N), C, xc,
                           z.reshape(Bn * T, Din)).view(Bn, T, -1)

    _, dy = torch.func.jvp(out, (s, xc, C, z), (ds, dxc, dC, dz))
    # the buffer after step t holds inputs t − K + 2 … t: rows t + 1 … t + K − 1 of x_ext
    ends = torch.cumsum(dx_ext.pow(2).sum(dim=-1), dim=1)  # (B, T + K − 1)
    return dy, ends[:, K - 1:] - ends[:, :T] + ds.pow(2).sum(dim=(-1, -2))
