"""The parallel read-out: each layer's gates from PyTorch's own h sequence, all steps at once.

PyTorch's kernel computes a layer's h sequence; the gates of all T steps then come from
one large GEMM on the previous h, and only the LSTM's c is sequential. Meant for GPUs,
where T small GEMMs waste the device; on the CPU the step-by-step path (cells.py) is
faster. The buffers have the layout of ``gatelens.trace.run_stack``.

>>> import torch
>>> from gatelens.trace import trace
>>> gru = torch.nn.GRU(3, 4)
>>> x = torch.randn(6, 2, 3)
>>> a, b = trace(gru, x), trace(gru, x, method="parallel")
>>> bool((a["layer0.z"] - b["layer0.z"]).abs().max() < 1e-6)
True
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from gatelens.cellspec import cell_of_mode
from gatelens.reference import copy_layers


def run_stack_parallel(module: nn.RNNBase, x: Tensor, h0: Tensor,
                       c0: Tensor | None) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """Like ``run_stack`` (unpacked input), but the gates of all T steps come from one large
    GEMM on the h sequence PyTorch's own kernel computes; only the LSTM's c is sequential.

    For GPUs, where T small GEMMs waste the device. Same layouts as ``run_stack``.
    """
    cell = cell_of_mode(module.mode)
    D = 2 if module.bidirectional else 1
    bufs: dict[str, Tensor] = {}
    h_n, c_n = [], []
    x = x.permute(0, 2, 1)  # (T, B, F)
    for layer in range(module.num_layers):
        ks = slice(layer * D, (layer + 1) * D)
        hx = h0[ks].transpose(1, 2).contiguous()  # (D, B, H_out)
        state = (hx, c0[ks].transpose(1, 2).contiguous()) if cell == "lstm" else hx
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*projections is not supported with oneDNN")
            out, _ = copy_layers(module, layer, 1, batch_first=False)(x, state)  # (T, B, D*H_out)
        H_out = out.shape[-1] // D
        for d in range(D):
            reverse, k = d == 1, layer * D + d
            sfx = f"_l{layer}{'_reverse' if reverse else ''}"
            w = {n: getattr(module, n + sfx, None) for n in _WEIGHTS}
            h_seq = out[..., d * H_out : (d + 1) * H_out]  # (T, B, H_out)
            h_init = h0[k].T[None]  # (1, B, H_out)
            prev = torch.cat([h_seq[1:], h_init]) if reverse else torch.cat([h_init, h_seq[:-1]])
            c_init = None if c0 is None else c0[k].T
            sig = _parallel_layer(cell, x, prev, w, c_init, reverse)
            h_n.append(sig["h"][0 if reverse else -1].T)
            if cell == "lstm":
                c_n.append(sig["c"][0 if reverse else -1].T)
            prefix = f"layer{layer}{'.reverse' if reverse else ''}."
            bufs.update({prefix + n: t.transpose(1, 2) for n, t in sig.items()})  # (T, R, B)
        x = out
    return bufs, torch.stack(h_n), (torch.stack(c_n) if c_n else None)


_WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")


def _parallel_layer(cell: str, x: Tensor, prev: Tensor, w: dict[str, Tensor | None],
                    c_init: Tensor | None, reverse: bool) -> dict[str, Tensor]:
    """All signals of one layer and direction, each (T, B, R), from inputs and previous h."""
    F = nn.functional
    gx = F.linear(x, w["weight_ih"], w["bias_ih"])  # (T, B, G)
    gh = F.linear(prev, w["weight_hh"], w["bias_hh"])  # (T, B, G)
    if cell.startswith("rnn"):
        pre = gh.add_(gx)
        return {"pre": pre, "h": torch.tanh(pre) if cell == "rnn_tanh" else torch.relu(pre)}
    if cell == "gru":
        H = gx.shape[-1] // 3
        rz = gh[..., : 2 * H].add_(gx[..., : 2 * H]).sigmoid_()
        r, z = rz[..., :H], rz[..., H:]
        n = gx[..., 2 * H :].add(gh[..., 2 * H :].mul_(r)).tanh_()
        return {"r": r, "z": z, "n": n, "h": (prev - n).mul_(z).add_(n)}
    gates = gh.add_(gx)
    H = gates.shape[-1] // 4
    i, f = gates[..., :H].sigmoid_(), gates[..., H : 2 * H].sigmoid_()
    g, o = gates[..., 2 * H : 3 * H].tanh_(), gates[..., 3 * H :].sigmoid_()
    c = torch.empty_like(i)  # (T, B, H): the one sequential part
    c_prev = c_init
    for t in range(c.shape[0] - 1, -1, -1) if reverse else range(c.shape[0]):
        torch.mul(f[t], c_prev, out=c[t])
        c[t].addcmul_(i[t], g[t])
        c_prev = c[t]
    m = torch.tanh(c).mul_(o)
    sig = {"i": i, "f": f, "g": g, "o": o, "c": c}
    if w["weight_hr"] is not None:
        sig["m"] = m
    sig["h"] = m if w["weight_hr"] is None else F.linear(m, w["weight_hr"])
    return sig
