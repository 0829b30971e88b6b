"""nn.LSTM as a family: its anchored read-out, PyTorch's own c, and the one-step check.

The anchored read-out (docs/methods.md) takes every gate from the layer's input and
PyTorch's own h_{t−1}, and c by the contraction c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t. It is laid
out for speed: time-major, one GEMM for W_hh h over every step (written into the input
projection in place), one-hot input as a gather of W_ih's columns (exactly the product), the
four activations in place, and the contraction as one fused call a step.

PyTorch's own c (for the one-step check and the dynamics) comes from its own cell run one
step at a time with the module's h_{t−1} passed along; it is computed once, on first use.

>>> import torch
>>> from gatelens.families.registry import family_of
>>> lstm = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True)
>>> fam = family_of(lstm); call = fam.check(torch.randn(2, 6, 3)); ref = fam.reference(call)
>>> ro = fam.read(call, ref)
>>> list(ro.signals)[:6], max(d.max_abs_diff_h for d in fam.one_step(call, ref)) < 1e-6
(['layer0.i', 'layer0.f', 'layer0.g', 'layer0.o', 'layer0.c', 'layer0.h'], True)
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from gatelens.cells.equations import cell_weights, step
from gatelens.cells.numerics import quiet_onednn
from gatelens.families.base import Call, LayerDiff, Readout, Reference
from gatelens.families.torch_rnn import TorchRNNFamily, like, max_diff, previous


def one_hot_ids(x: Tensor) -> Tensor | None:
    """The indices of a one-hot (B, T, V) input, or None when it is not one-hot.

    >>> one_hot_ids(torch.eye(3)[None]).tolist(), one_hot_ids(torch.ones(1, 2, 3))
    ([[0, 1, 2]], None)
    """
    if x.ndim != 3 or not bool(((x == 0) | (x == 1)).all()) or not bool((x.sum(-1) == 1).all()):
        return None
    return x.argmax(dim=-1)


def input_projection(w_ih: Tensor, x: Tensor, ids: Tensor | None) -> Tensor:
    """W_ih x_t for every step, time-major (T, B, G) and contiguous. A one-hot input is a
    gather of W_ih's columns: the product has one non-zero term, so the two are equal."""
    if ids is not None:
        return w_ih.t().contiguous()[ids.t().contiguous()]  # (T, B, G)
    return torch.matmul(x.transpose(0, 1).contiguous(), w_ih.t())  # (T, B, G)


def add_recurrent(pre: Tensor, h: Tensor, h0: Tensor, w_hh: Tensor, reverse: bool) -> None:
    """pre_t += W_hh h_{t−1} in place for every step, h_{t−1} the module's own (h (B, T, H_out)
    batch first, h0 (B, H_out)): one GEMM over all steps, written into ``pre`` (T, B, G)."""
    T, B, G = pre.shape
    hT = h.transpose(0, 1)  # (T, B, H_out)
    if not hT.is_contiguous():
        hT = hT.contiguous()
    flat = pre.view(T * B, G)
    if T > 1:
        src = hT[1:] if reverse else hT[:-1]  # (T − 1, B, H_out)
        dst = flat[: (T - 1) * B] if reverse else flat[B:]
        dst.addmm_(src.reshape(-1, src.shape[-1]), w_hh.t())
    first = pre[T - 1] if reverse else pre[0]
    first.addmm_(h0, w_hh.t())


class LSTMFamily(TorchRNNFamily):
    """nn.LSTM, any layers, directions, bias, projection."""

    name = "lstm"
    opens_what = "nn.LSTM"
    module_class = nn.LSTM
    state_parts: ClassVar[tuple[str, ...]] = ("h", "c")

    def read(self, call: Call, ref: Reference) -> Readout:
        """Gates from the layer's input and PyTorch's h_{t−1}; c by the contraction."""
        out: dict[str, Tensor] = {}
        h_n, c_n = [], []
        with torch.no_grad():
            for k, reverse, name, _ in self.directions_of():
                sig = self._read_layer(call, ref, k, reverse, name)
                out.update({f"{name}.{s}": t for s, t in sig.items()})
                last = 0 if reverse else -1  # the reverse direction ends at t = 0
                h_n.append(sig["h"][:, last])
                c_n.append(sig["c"][:, last])
        return Readout({n: out[n] for n in self.names()}, torch.stack(h_n), torch.stack(c_n),
                       {"method": "anchored"})

    def _read_layer(self, call: Call, ref: Reference, k: int, reverse: bool,
                    name: str) -> dict[str, Tensor]:
        w = cell_weights(self.module, k, reverse)
        X = ref.inputs[f"layer{k}"]  # (B, T, F_k)
        h0, c0 = ref.initial[name]
        T = X.shape[1]
        pre = input_projection(w.w_ih, X, one_hot_ids(X) if k == 0 else None)  # (T, B, 4H)
        if w.b_ih is not None:
            pre += w.b_ih + w.b_hh
        add_recurrent(pre, ref.states[name + ".h"], h0, w.w_hh, reverse)
        i, f, g, o = pre.chunk(4, dim=-1)  # (T, B, H) views
        for gate in (i, f, o):
            gate.sigmoid_()
        g.tanh_()
        u = i * g  # (T, B, H): what the cell writes
        c = torch.empty_like(u)
        prev = c0
        for t in range(T - 1, -1, -1) if reverse else range(T):
            torch.addcmul(u[t], f[t], prev, out=c[t])  # c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t
            prev = c[t]
        m = o * torch.tanh(c)  # (T, B, H)
        sig = {"i": i, "f": f, "g": g, "o": o, "c": c}
        if w.w_hr is not None:
            sig["m"] = m
            m = torch.matmul(m, w.w_hr.t())  # (T, B, P)
        sig["h"] = m
        return {s: t.transpose(0, 1) for s, t in sig.items()}  # (B, T, ·)

    # ---- PyTorch's own c ------------------------------------------------------------------
    def trajectory_states(self, call: Call, ref: Reference) -> dict[str, Tensor]:
        """PyTorch's h, and its c from its own cell run one step at a time (cached)."""
        if "stepped_c" not in ref.extra:
            gap = 0.0
            for k, reverse, name, _ in self.directions_of():
                c, h_step = self._stepped_c(ref, k, reverse, name)
                ref.states[name + ".c"] = c
                gap = max(gap, max_diff(h_step, ref.states[name + ".h"]))
            ref.extra["stepped_c"] = True
            # the h of those step calls against the module's output: 0 on CPU
            ref.extra["stepped_vs_sequence_max_abs_diff_h"] = gap
        return ref.states

    def _direction(self, k: int, reverse: bool) -> nn.LSTM:
        """A one-layer, one-direction LSTM holding that direction's tensors."""
        sfx = f"_l{k}{'_reverse' if reverse else ''}"
        tensors = {n.replace(sfx, "_l0"): p.detach() for n, p in self.module.named_parameters()
                   if n.endswith(sfx)}
        return like(self.module, 1, tensors, bidirectional=False,
                    input_size=tensors["weight_ih_l0"].shape[1])

    def _stepped_c(self, ref: Reference, k: int, reverse: bool,
                   name: str) -> tuple[Tensor, Tensor]:
        """c at every step from PyTorch's own cell, one call a step (B, T, H); and the h each
        call returned (B, T, H_out), to show the calls sat on the module's trajectory."""
        cell = self._direction(k, reverse)
        X, h = ref.inputs[f"layer{k}"], ref.states[name + ".h"]
        h_init, c_prev = ref.initial[name]
        T = X.shape[1]
        c_out, h_out = [None] * T, [None] * T
        with torch.no_grad(), quiet_onednn():
            for t in range(T - 1, -1, -1) if reverse else range(T):
                first = t == (T - 1 if reverse else 0)
                h_prev = h_init if first else h[:, t + 1 if reverse else t - 1]
                y, (_, c_n) = cell(X[:, t : t + 1], (h_prev[None], c_prev[None]))
                c_prev = c_n[0]  # (B, H)
                c_out[t], h_out[t] = c_prev, y[:, 0]
        return torch.stack(c_out, dim=1), torch.stack(h_out, dim=1)

    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        """The hand cell (equations.py) fed PyTorch's h and c at t − 1, against them at t."""
        st = self.trajectory_states(call, ref)
        rows = []
        with torch.no_grad():
            for k, reverse, name, _ in self.directions_of():
                h0, c0 = ref.initial[name]
                sig = step(cell_weights(self.module, k, reverse), ref.inputs[f"layer{k}"],
                           previous(st[name + ".h"], h0, reverse),
                           previous(st[name + ".c"], c0, reverse))
                dc, sc = (max_diff(sig["c"], st[name + ".c"], s) for s in (False, True))
                rows.append(LayerDiff(k, reverse, max_diff(sig["h"], st[name + ".h"]), dc, sc))
        return rows
