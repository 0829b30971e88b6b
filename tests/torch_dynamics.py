"""``Dynamics`` of an nn.LSTM / nn.GRU / nn.RNN, built the way the divergence rate builds them.

A test helper until the families (``families/lstm.py`` …) provide ``dynamics(call, ref)``:
the whole stack's step from ``gatelens.cells.equations`` (layer k reads layer k − 1's new h
of the same step), the carried state per layer h then c (LSTM), the trajectory PyTorch's own
(``families.anchored.module_states``), and for a bidirectional module one Dynamics a
direction with every layer's input fixed to the module's own lower-layer output, exactly as
``analysis.divergence.divergence_rate`` does. Tests load it through the ``torch_dynamics``
fixture of conftest.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.cells.equations import cell_weights, step
from gatelens.families.anchored import check_inputs, module_states
from gatelens.families.base import Dynamics


def torch_dynamics(module: nn.RNNBase, inputs: Tensor, state=None) -> list[Dynamics]:
    """One Dynamics per direction of ``module`` on ``inputs`` (B, T, F), batch first."""
    cell, h0, c0 = check_inputs(module, inputs, state)
    st = module_states(module, inputs, state)
    D, L, H = 2 if module.bidirectional else 1, module.num_layers, module.hidden_size
    per = 2 if cell == "lstm" else 1
    proj = cell == "lstm" and module.proj_size > 0
    x = inputs.detach().double()  # (B, T, F)
    T = x.shape[1]
    out = []
    for d, name in enumerate(("forward", "reverse")[:D]):
        sfx = ".reverse" if d else ""
        ws = [cell_weights(module, k, bool(d), dtype=torch.float64) for k in range(L)]
        traj, init, units = [], [], []
        for k in range(L):
            j = k * D + d
            traj.append(st[f"layer{k}{sfx}.h"].double())  # (B, T, H_out)
            init.append(h0[j].double())
            units.append(torch.full((ws[k].output_size,), -1) if proj
                         else k * H + torch.arange(H))
            if cell == "lstm":
                traj.append(st[f"layer{k}{sfx}.c"].double())  # (B, T, H)
                init.append(c0[j].double())
                units.append(k * H + torch.arange(H))
        if D == 1:
            xs, widths = x, [x.shape[-1]]
        else:  # every layer's input fixed to the module's own lower-layer output
            below = [torch.cat([st[f"layer{k}.h"], st[f"layer{k}.reverse.h"]], -1).double()
                     for k in range(L - 1)]  # (B, T, 2·H_out) each
            xs = torch.cat([x] + below, dim=-1)  # (B, T, F + (L − 1)·2·H_out)
            widths = [x.shape[-1]] + [b.shape[-1] for b in below]

        def stack(xt: Tensor, s, ws=ws, widths=widths, fixed=D == 2) -> list[Tensor]:
            inp = list(xt.split(widths, dim=-1))
            new, below = [], inp[0]
            for k, w in enumerate(ws):
                sig = step(w, inp[k] if fixed else below, *s[per * k: per * (k + 1)])
                new += [sig["h"], sig["c"]] if per == 2 else [sig["h"]]
                below = sig["h"]
            return new

        order = list(range(T - 1, -1, -1)) if d else list(range(T))
        out.append(Dynamics(step=stack, inputs=xs, trajectory=traj, initial=init, order=order,
                            units=torch.cat(units).long(), name=name))
    return out


def modern_dynamics(module: nn.Module, inputs: Tensor, state=None) -> list[Dynamics]:
    """The Dynamics of a gatelens cell (modern.py) as ``divergence._modern_rate`` runs it:
    its float64 copy's own trajectory on ``stack_step``'s state, from step 1 on (step 0
    set the state from the initial one, so ``offset`` is 1)."""
    import copy

    m64 = copy.deepcopy(module).double().eval()
    x = inputs.detach().double()  # (B, T, F)
    traj = [p.detach() for p in m64.free_states(m64.trace(x, state))]  # (B, T, H) each
    L, H, T = m64.num_layers, m64.hidden_size, x.shape[1]
    per = len(traj) // L
    units = torch.cat([k * H + torch.arange(H) for k in range(L) for _ in range(per)])
    return [Dynamics(step=lambda xt, s: m64.stack_step(xt, list(s)), inputs=x,
                     trajectory=traj, initial=[p[:, 0] for p in traj],
                     order=list(range(1, T)), units=units, offset=1)]
