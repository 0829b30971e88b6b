"""nn.LSTM as a family: its anchored read-out, PyTorch's own c, and the one-step check.

The anchored read-out (docs/methods.md) takes every gate from the layer's input and
PyTorch's own h_{t−1}, c by the contraction c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t, and h as
PyTorch's own (as for the GRU and the RNN; a projected LSTM's m = o ⊙ tanh c is computed). It
is laid out for speed: time-major blocks of steps small enough to stay in cache while every
pass runs over them, one GEMM for W_hh h of a block written into its input projection in
place, one-hot input as a gather of W_ih's columns (exactly the product), the three sigmoid
gates in one call, and the contraction as one fused call a step.

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
from gatelens.cells.names import layer_name
from gatelens.cells.numerics import quiet_onednn
from gatelens.families.base import Call, LayerDiff, Readout, Reference
from gatelens.families.records import nan_max
from gatelens.families.spec import SIGMOID, TANH, CellSpec
from gatelens.families.torch_ops import flat_names, weights_of
from gatelens.families.torch_rnn import TorchRNNFamily, like, max_diff, previous
from gatelens.families.torch_train import torch_recipe

#: a reader's names of the LSTM's gates
LSTM_NAMES = {"i": "input", "f": "forget", "g": "candidate", "o": "output"}
LSTM = CellSpec(
    name="lstm", kind="lstm", mode="LSTM", chunks=("i", "f", "g", "o"),
    signals=("i", "f", "g", "o", "c", "h"), gates=("i", "f", "g", "o"),
    keep_gate="f", input_gate="i", state="c",
    bounds={"i": SIGMOID, "f": SIGMOID, "o": SIGMOID, "g": TANH}, display=LSTM_NAMES,
    return_path=("i", "f", "g", "o"), carried=("h", "c"))


def one_hot_ids(x: Tensor) -> Tensor | None:
    """The indices of a one-hot (B, T, V) input, or None when it is not one-hot.

    >>> one_hot_ids(torch.eye(3)[None]).tolist(), one_hot_ids(torch.ones(1, 2, 3))
    ([[0, 1, 2]], None)
    """
    if x.ndim != 3 or not x.is_floating_point() or 0 in x.shape:
        return None
    lo, hi = torch.aminmax(x, dim=-1)  # (B, T) each: one pass
    # every entry ≥ 0, the largest 1 and the sum 1: then all the others are 0
    if not (bool((lo >= 0).all()) and bool((hi == 1).all()) and bool((x.sum(-1) == 1).all())):
        return None
    return x.argmax(dim=-1)


def input_projection(w_ih: Tensor, x: Tensor, ids: Tensor | None,
                     bias: Tensor | None = None) -> Tensor:
    """W_ih x_t (+ bias) for every step, time-major (T, B, G) and contiguous. A one-hot
    input is a gather of W_ih's columns (bias added to the table first): the product has one
    non-zero term, so the two are equal."""
    if ids is not None:
        table = w_ih.t() if bias is None else w_ih.t() + bias  # (V, G)
        return table.contiguous()[ids.t().contiguous()]  # (T, B, G)
    out = torch.matmul(x.transpose(0, 1).contiguous(), w_ih.t())  # (T, B, G)
    return out if bias is None else out.add_(bias)


def _add_previous(blk: Tensor, hT: Tensor, h0: Tensor, w_hh_t: Tensor, t0: int, t1: int,
                  B: int, reverse: bool) -> None:
    """Steps t0 … t1 − 1 of the pre-activations, (rows, 4H), += W_hh h_{t−1} in place, with
    h_{t−1} the module's own (hT (T, B, H_out) time-major; h0 before the first step)."""
    T = hT.shape[0]
    if not reverse:
        lo = t0 - 1  # step t reads h_{t−1}
        if lo < 0:
            blk[:B].addmm_(h0, w_hh_t)
            rows, lo = blk[B:], 0
        else:
            rows = blk
        if rows.shape[0]:
            rows.addmm_(hT[lo : t1 - 1].reshape(-1, hT.shape[-1]), w_hh_t)
        return
    hi = t1 + 1  # the reverse direction: step t reads h_{t+1}
    if hi > T:
        blk[-B:].addmm_(h0, w_hh_t)
        rows, hi = blk[:-B], T
    else:
        rows = blk
    if rows.shape[0]:
        rows.addmm_(hT[t0 + 1 : hi].reshape(-1, hT.shape[-1]), w_hh_t)


class LSTMFamily(TorchRNNFamily):
    """nn.LSTM, any layers, directions, bias, projection."""

    name = "lstm"
    opens_what = "nn.LSTM"
    module_class = nn.LSTM
    specs = (LSTM,)
    recipe = torch_recipe("lstm", nn.LSTM, specs, "LSTM f", "PyTorch's nn.LSTM (the seed's cell)")
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
        X = ref.inputs[layer_name(k)]  # (B, T, F_k)
        h0, c0 = ref.initial[name]
        B, T, H = X.shape[0], X.shape[1], self.hidden_size
        # rows reordered once to i, f, o, g, so one sigmoid covers the three gates
        order = torch.cat([torch.arange(2 * H), torch.arange(3 * H, 4 * H),
                           torch.arange(2 * H, 3 * H)]).to(w.w_ih.device)
        bias = None if w.b_ih is None else (w.b_ih + w.b_hh)[order]
        w_ih, w_hh_t = w.w_ih[order], w.w_hh[order].t().contiguous()  # (4H, F), (H_out, 4H)
        ids = one_hot_ids(X) if k == 0 else None
        # one-hot input: a gather of W_ih's columns (the product's one non-zero term), bias in
        table = None if ids is None else (w_ih.t() if bias is None else w_ih.t() + bias
                                          ).contiguous()  # (V, 4H)
        src = (ids if ids is None else ids.t().contiguous(),
               None if ids is not None else X.transpose(0, 1).contiguous())  # (T, B[, F])
        hT = ref.states[name + ".h"].transpose(0, 1).contiguous()  # (T, B, H_out)
        pre = X.new_empty(T, B, 4 * H)  # i, f, o, g: the trace's gates live here
        c = X.new_empty(T, B, H)
        m = X.new_empty(T, B, H) if w.w_hr is not None else None
        prev = c0
        # blocks of steps small enough to stay in cache while every pass runs over them
        step = max(1, (1 << 23) // max(1, B * 4 * H * X.element_size()))
        starts = list(range(0, T, step))
        for t0 in reversed(starts) if reverse else starts:
            t1 = min(T, t0 + step)
            blk = pre[t0:t1].view(-1, 4 * H)  # ((t1 − t0)·B, 4H)
            if table is not None:
                torch.index_select(table, 0, src[0][t0:t1].reshape(-1), out=blk)
            else:
                torch.mm(src[1][t0:t1].reshape(-1, X.shape[-1]), w_ih.t(), out=blk)
                if bias is not None:
                    blk += bias
            _add_previous(blk, hT, h0, w_hh_t, t0, t1, B, reverse)
            blk[:, : 3 * H].sigmoid_()
            blk[:, 3 * H :].tanh_()
            i, f, o, g = pre[t0:t1].chunk(4, dim=-1)  # (τ, B, H) views
            torch.mul(i, g, out=c[t0:t1])  # what the cell writes, then the contraction:
            for t in range(t1 - 1, t0 - 1, -1) if reverse else range(t0, t1):
                c[t].addcmul_(f[t - t0], prev)  # c_t = i_t ⊙ g_t + f_t ⊙ c_{t−1}
                prev = c[t]
            if m is not None:  # projected: m = o ⊙ tanh(c), before h = W_hr m
                torch.tanh(c[t0:t1], out=m[t0:t1])
                m[t0:t1].mul_(o)
        i, f, o, g = pre.chunk(4, dim=-1)  # (T, B, H)
        sig = {s: v.transpose(0, 1) for s, v in
               {"i": i, "f": f, "g": g, "o": o, "c": c}.items()}  # (B, T, ·)
        if m is not None:
            sig["m"] = m.transpose(0, 1)
        sig["h"] = ref.states[name + ".h"]  # PyTorch's own h, as for the GRU and the RNN
        return sig

    # ---- PyTorch's own c ------------------------------------------------------------------
    def trajectory_states(self, call: Call, ref: Reference) -> dict[str, Tensor]:
        """PyTorch's h, and its c from its own cell run one step at a time (cached)."""
        if "stepped_c" not in ref.extra:
            gap = 0.0
            for k, reverse, name, _ in self.directions_of():
                c, h_step = self._stepped_c(ref, k, reverse, name)
                ref.states[name + ".c"] = c
                gap = nan_max(gap, max_diff(h_step, ref.states[name + ".h"]))
            ref.extra["stepped_c"] = True
            # the h of those step calls against the module's output: 0 on CPU
            ref.extra["stepped_vs_sequence_max_abs_diff_h"] = gap
        return ref.states

    def _direction(self, k: int, reverse: bool) -> nn.LSTM:
        """A one-layer, one-direction LSTM holding that direction's tensors."""
        sfx = f"_l{k}{'_reverse' if reverse else ''}"
        names = [n for n in flat_names(self.module) if n.endswith(sfx)]
        tensors = {n.replace(sfx, "_l0"): w for n, w in weights_of(self.module, names).items()}
        return like(self.module, 1, tensors, bidirectional=False,
                    input_size=tensors["weight_ih_l0"].shape[1])

    def _stepped_c(self, ref: Reference, k: int, reverse: bool,
                   name: str) -> tuple[Tensor, Tensor]:
        """c at every step from PyTorch's own cell, one call a step (B, T, H); and the h each
        call returned (B, T, H_out), to show the calls sat on the module's trajectory."""
        cell = self._direction(k, reverse)
        X, h = ref.inputs[layer_name(k)], ref.states[name + ".h"]
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
                sig = step(cell_weights(self.module, k, reverse), ref.inputs[layer_name(k)],
                           previous(st[name + ".h"], h0, reverse),
                           previous(st[name + ".c"], c0, reverse))
                dc, sc = (max_diff(sig["c"], st[name + ".c"], s) for s in (False, True))
                rows.append(LayerDiff(k, reverse, max_diff(sig["h"], st[name + ".h"]), dc, sc))
        return rows
