"""PyTorch's recurrent cells, re-run step by step from a module's own weights.

The equations are those of docs/methods.md (and of ATen's CPU cells, op for op): LSTM
i, f, g, o; GRU r, z, n; plain RNN with tanh or relu. Everything here works in a
time-major, transposed layout: a buffer is ``(T, R, B)`` with R the rows of one signal
(4H LSTM gates, H units, ...) and B the batch last. Why transposed: at the sizes gatelens
cares about (B = 32, H = 325) ``W_hh @ h^T`` is the faster GEMM, and every gate block of
one step, ``buf[t, rows]``, is then one contiguous ``(rows, B)`` slab, so a single
in-place ``sigmoid_`` covers i, f and o at once and no step copies anything.

LSTM rows are permuted once from PyTorch's (i, f, g, o) to (i, f, o, g) for that reason;
the permutation is a re-indexing of weights, not a change of arithmetic.

>>> import torch
>>> lstm = torch.nn.LSTM(3, 4)
>>> w = layer_weights(lstm, "lstm", 0, reverse=False)
>>> w.w_ih.shape, w.w_hh.shape
(torch.Size([16, 3]), torch.Size([16, 4]))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LayerWeights:
    """One layer and direction's tensors, rows in buffer order (LSTM: i, f, o, g)."""

    w_ih: Tensor  # (G, F)  G = 4H (LSTM), 3H (GRU), H (RNN)
    w_hh: Tensor  # (G, H_out)  H_out = proj_size or H
    b_x: Tensor | None  # (G, 1) bias added to the input projection
    b_h: Tensor | None  # (G, 1) bias added to W_hh h each step (GRU: b_hh, kept apart for r ⊙ …)
    w_hr: Tensor | None  # (P, H) LSTM projection, else None


def layer_weights(module: nn.RNNBase, cell: str, layer: int, reverse: bool) -> LayerWeights:
    """Read one layer and direction's weights from ``module`` (read only, never modified)."""
    sfx = f"_l{layer}{'_reverse' if reverse else ''}"
    w_ih = getattr(module, "weight_ih" + sfx).detach()
    w_hh = getattr(module, "weight_hh" + sfx).detach()
    b_ih = getattr(module, "bias_ih" + sfx).detach() if module.bias else None
    b_hh = getattr(module, "bias_hh" + sfx).detach() if module.bias else None
    proj = cell == "lstm" and module.proj_size > 0
    w_hr = getattr(module, "weight_hr" + sfx).detach() if proj else None
    if cell == "gru":
        # r, z, n stay in PyTorch's order; b_hh must stay apart because n uses r ⊙ (W_hn h + b_hn).
        return LayerWeights(w_ih, w_hh, _col(b_ih), _col(b_hh), w_hr)
    b = None if b_ih is None else b_ih + b_hh
    if cell == "lstm":
        H = module.hidden_size
        ar = torch.arange(4 * H, device=w_ih.device)
        idx = torch.cat([ar[: 2 * H], ar[3 * H :], ar[2 * H : 3 * H]])  # i, f, o, g
        w_ih, w_hh = w_ih[idx], w_hh[idx]
        b = None if b is None else b[idx]
    return LayerWeights(w_ih, w_hh, _col(b), None, w_hr)


def _col(b: Tensor | None) -> Tensor | None:
    return None if b is None else b.reshape(-1, 1)


@dataclass(frozen=True)
class Schedule:
    """Which time steps run in which order, and how many batch columns are live at each.

    ``lengths`` (packed input only) are sorted in decreasing order, so the live columns of
    step t are the first ``sizes[j]``; ``sizes`` is None when every column is live.
    """

    T: int
    reverse: bool
    lengths: Tensor | None = None  # (B,) int64, decreasing, on the buffers' device

    @property
    def order(self) -> list[int]:
        return list(range(self.T - 1, -1, -1)) if self.reverse else list(range(self.T))

    @property
    def sizes(self) -> list[int] | None:
        if self.lengths is None:
            return None
        lens = self.lengths.tolist()
        return [sum(1 for n in lens if n > t) for t in self.order]


def _views(buf: Tensor, s: Schedule, sizes: list[int] | None) -> list[Tensor]:
    """``buf[t]`` (R, B_live) for each step, in processing order."""
    if sizes is None:
        views = buf.unbind(0)
        return list(views[::-1] if s.reverse else views)
    return [buf[t, :, :n] for t, n in zip(s.order, sizes, strict=True)]


def _prev(buf: Tensor, init: Tensor, s: Schedule, sizes: list[int] | None) -> list[Tensor]:
    """The state each step reads: ``init`` first, then the previous step's output.

    Packed reverse: a column whose length is len starts at t = len - 1 and reads slot
    len, which ``_prefill`` has set to ``init`` for it.
    """
    if sizes is None:
        return [init] + _views(buf, s, None)[:-1]
    rest = [buf[p, :, :n] for p, n in zip(s.order[:-1], sizes[1:], strict=True)]
    return [init[:, : sizes[0]]] + rest


def _prefill(buf: Tensor, init: Tensor, s: Schedule) -> None:
    if s.lengths is None or not s.reverse:
        return
    cols = (s.lengths < s.T).nonzero().flatten()
    buf[s.lengths[cols], :, cols] = init[:, cols].T  # (n, R)


def _zero_padding(bufs: list[Tensor], s: Schedule) -> None:
    if s.lengths is None:
        return
    t = torch.arange(s.T, device=s.lengths.device)
    pad = (t[:, None] >= s.lengths[None, :])[:, None, :]  # (T, 1, B)
    for buf in bufs:
        buf.masked_fill_(pad, 0)


def final_state(buf: Tensor, s: Schedule) -> Tensor:
    """The state after the last step of every column, (R, B)."""
    if s.reverse:
        return buf[0]
    if s.lengths is None:
        return buf[s.T - 1]
    return buf[s.lengths - 1, :, torch.arange(buf.shape[2], device=buf.device)].T


class LstmStep(NamedTuple):
    """One LSTM step's (rows, B) slabs, bound by name so no two can be swapped unseen."""

    gates: Tensor  # (4H, B) all four pre-activations, rows i, f, o, g
    ifo: Tensor  # (3H, B) the sigmoid rows
    i: Tensor
    f: Tensor
    o: Tensor
    g: Tensor
    h_prev: Tensor  # (H_out, B) the state this step reads
    c_prev: Tensor  # (H, B)
    c: Tensor  # (H, B) written
    m: Tensor  # (H, B) o ⊙ tanh(c), written (the h slab itself when not projected)
    h: Tensor  # (H_out, B) written


class GruStep(NamedTuple):
    """One GRU step's slabs by name."""

    rz: Tensor  # (2H, B) the sigmoid rows
    r: Tensor
    z: Tensor
    n: Tensor
    h_prev: Tensor
    h: Tensor


class RnnStep(NamedTuple):
    """One plain RNN step's slabs by name."""

    pre: Tensor
    h_prev: Tensor
    h: Tensor


def _bind(step: type, s: Schedule, sizes: list[int] | None, **bufs) -> list:
    """Per-step views of every buffer, in processing order, as ``step`` tuples by name.

    A plain buffer gives ``buf[t]``; a pair ``(buf, init)`` gives the state step t reads
    (``init`` first, then the previous step's output).
    """
    views = {name: _prev(b[0], b[1], s, sizes) if isinstance(b, tuple) else _views(b, s, sizes)
             for name, b in bufs.items()}
    return [step(**dict(zip(views, row, strict=True)))
            for row in zip(*views.values(), strict=True)]


def project(w: LayerWeights, x: Tensor, out: Tensor) -> Tensor:
    """Input projection of all T steps at once: ``out[t] = W_ih x_t (+ b)``, (T, G, B).

    One batched GEMM per call; each step's product is its own GEMM, so a step's value
    does not depend on how many steps are projected together (chunked == one shot).
    """
    torch.matmul(w.w_ih, x, out=out)  # (G, F) @ (T, F, B) -> (T, G, B)
    if w.b_x is not None:
        out.add_(w.b_x)
    return out


def run_lstm(xw: Tensor, w: LayerWeights, h0: Tensor, c0: Tensor, s: Schedule,
             h_buf: Tensor) -> dict[str, Tensor]:
    """LSTM over a schedule. ``xw`` (T, 4H, B) is the input projection; it becomes the gates.

    Writes h into ``h_buf`` (T, H_out, B); returns the (T, ·, B) buffers by signal letter.
    """
    T, G, B = xw.shape
    H = G // 4
    sizes = s.sizes
    c_buf = xw.new_empty(T, H, B)
    m_buf = xw.new_empty(T, H, B) if w.w_hr is not None else h_buf
    _prefill(c_buf, c0, s)
    _prefill(h_buf, h0, s)
    steps = _bind(LstmStep, s, sizes, gates=xw, ifo=xw[:, : 3 * H], g=xw[:, 3 * H :],
                  i=xw[:, :H], f=xw[:, H : 2 * H], o=xw[:, 2 * H : 3 * H], c=c_buf, m=m_buf,
                  h=h_buf, h_prev=(h_buf, h0), c_prev=(c_buf, c0))
    w_hh, w_hr, mul, tanh, mm = w.w_hh, w.w_hr, torch.mul, torch.tanh, torch.mm
    for st in steps:
        st.gates.addmm_(w_hh, st.h_prev)  # (4H, B) += W_hh h
        st.ifo.sigmoid_()
        st.g.tanh_()
        mul(st.f, st.c_prev, out=st.c)  # c' = f ⊙ c + i ⊙ g
        st.c.addcmul_(st.i, st.g)
        tanh(st.c, out=st.m)  # m = o ⊙ tanh(c')
        st.m.mul_(st.o)
        if w_hr is not None:
            mm(w_hr, st.m, out=st.h)  # (P, B) = W_hr m
    out = {"i": xw[:, :H], "f": xw[:, H : 2 * H], "g": xw[:, 3 * H :], "o": xw[:, 2 * H : 3 * H],
           "c": c_buf}
    if w_hr is not None:
        out["m"] = m_buf
    out["h"] = h_buf
    _zero_padding([xw, c_buf, h_buf] + ([m_buf] if w_hr is not None else []), s)
    return out


def run_gru(xw: Tensor, w: LayerWeights, h0: Tensor, s: Schedule,
            h_buf: Tensor) -> dict[str, Tensor]:
    """GRU over a schedule, ATen's op order: n = tanh(x_n + r ⊙ (W_hn h + b_hn)),
    h' = (h - n) ⊙ z + n. ``xw`` (T, 3H, B) holds W_i x + b_i and becomes r, z, n."""
    T, G, B = xw.shape
    H = G // 3
    sizes = s.sizes
    _prefill(h_buf, h0, s)
    hh = xw.new_empty(G, B)  # W_hh h + b_hh of the current step
    hhs = [hh] * T if sizes is None else [hh[:, :n] for n in sizes]
    steps = _bind(GruStep, s, sizes, rz=xw[:, : 2 * H], r=xw[:, :H], z=xw[:, H : 2 * H],
                  n=xw[:, 2 * H :], h=h_buf, h_prev=(h_buf, h0))
    w_hh, b_h, addmm, mm, sub = w.w_hh, w.b_h, torch.addmm, torch.mm, torch.sub
    for st, hh_t in zip(steps, hhs, strict=True):
        if b_h is None:
            mm(w_hh, st.h_prev, out=hh_t)
        else:
            addmm(b_h, w_hh, st.h_prev, out=hh_t)  # (3H, B) = W_hh h + b_hh
        st.rz.add_(hh_t[: 2 * H]).sigmoid_()
        hh_n = hh_t[2 * H :].mul_(st.r)  # r ⊙ (W_hn h + b_hn)
        st.n.add_(hh_n).tanh_()
        sub(st.h_prev, st.n, out=st.h)  # h' = (h - n) ⊙ z + n
        st.h.mul_(st.z).add_(st.n)
    _zero_padding([xw, h_buf], s)
    return {"r": xw[:, :H], "z": xw[:, H : 2 * H], "n": xw[:, 2 * H :], "h": h_buf}


def run_rnn(xw: Tensor, w: LayerWeights, h0: Tensor, s: Schedule, h_buf: Tensor,
            relu: bool) -> dict[str, Tensor]:
    """Plain RNN: pre = W_ih x + b_ih + W_hh h + b_hh; h' = tanh(pre) or relu(pre)."""
    sizes = s.sizes
    _prefill(h_buf, h0, s)
    steps = _bind(RnnStep, s, sizes, pre=xw, h=h_buf, h_prev=(h_buf, h0))
    w_hh = w.w_hh
    if relu:
        for st in steps:
            st.pre.addmm_(w_hh, st.h_prev)
            torch.clamp_min(st.pre, 0, out=st.h)  # ATen's relu is clamp_min(0)
    else:
        for st in steps:
            st.pre.addmm_(w_hh, st.h_prev)
            torch.tanh(st.pre, out=st.h)
    _zero_padding([xw, h_buf], s)
    return {"pre": xw, "h": h_buf}




def run_stack(module: nn.RNNBase, cell: str, x: Tensor, h0: Tensor, c0: Tensor | None = None,
              lengths: Tensor | None = None) -> tuple[dict[tuple, Tensor], Tensor, Tensor | None]:
    """Every layer and direction of ``module`` on ``x`` (T, F, B) from states (L·D, ·, B):
    the signal buffers (T, R, B) by (layer, reverse, letter), h_n (L·D, H_out, B) and
    c_n (L·D, H, B) or None. Dropout between layers is not applied (inference).

    >>> lstm = torch.nn.LSTM(3, 4)
    >>> bufs, h_n, c_n = run_stack(lstm, "lstm", torch.randn(5, 3, 2), torch.zeros(1, 4, 2),
    ...                            torch.zeros(1, 4, 2))
    >>> sorted(bufs)[:2], tuple(h_n.shape)
    ([(0, False, 'c'), (0, False, 'f')], (1, 4, 2))
    """
    D = 2 if module.bidirectional else 1
    H_out = getattr(module, "proj_size", 0) or module.hidden_size
    T, _, B = x.shape
    G = {"lstm": 4, "gru": 3}.get(cell, 1) * module.hidden_size
    bufs: dict[str, Tensor] = {}
    h_n, c_n = [], []
    for layer in range(module.num_layers):
        h_cat = x.new_empty(T, D * H_out, B)  # both directions' h: the next layer's input
        for d in range(D):
            reverse, k = d == 1, layer * D + d
            w = layer_weights(module, cell, layer, reverse)
            s = Schedule(T, reverse, lengths)
            xw = project(w, x, x.new_empty(T, G, B))  # (T, G, B)
            h_buf = h_cat[:, d * H_out : (d + 1) * H_out]  # (T, H_out, B)
            if cell == "lstm":
                sig = run_lstm(xw, w, h0[k], c0[k], s, h_buf)
                c_n.append(final_state(sig["c"], s))
            elif cell == "gru":
                sig = run_gru(xw, w, h0[k], s, h_buf)
            else:
                sig = run_rnn(xw, w, h0[k], s, h_buf, relu=cell == "rnn_relu")
            h_n.append(final_state(h_buf, s))
            bufs.update({(layer, reverse, name): t for name, t in sig.items()})
        x = h_cat
    return bufs, torch.stack(h_n), (torch.stack(c_n) if c_n else None)
