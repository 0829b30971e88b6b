"""PyTorch's recurrent cells, re-run step by step from a module's own weights.

The equations are those of METHODS.md (and of ATen's CPU cells, op for op): LSTM
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

import contextlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

#: ATen's mode string of each module -> gatelens cell name.
CELL_OF_MODE = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


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


def _final(buf: Tensor, s: Schedule) -> Tensor:
    """The state after the last step of every column, (R, B)."""
    if s.reverse:
        return buf[0]
    if s.lengths is None:
        return buf[s.T - 1]
    return buf[s.lengths - 1, :, torch.arange(buf.shape[2], device=buf.device)].T


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
    steps = zip(
        _views(xw, s, sizes), _views(xw[:, : 3 * H], s, sizes), _views(xw[:, 3 * H :], s, sizes),
        _views(xw[:, :H], s, sizes), _views(xw[:, H : 2 * H], s, sizes),
        _views(xw[:, 2 * H : 3 * H], s, sizes), _prev(h_buf, h0, s, sizes),
        _prev(c_buf, c0, s, sizes), _views(c_buf, s, sizes), _views(m_buf, s, sizes),
        _views(h_buf, s, sizes), strict=True,
    )
    w_hh, w_hr, mul, tanh, mm = w.w_hh, w.w_hr, torch.mul, torch.tanh, torch.mm
    for gates, ifo, g, i, f, o, h_prev, c_prev, c, m, h in steps:
        gates.addmm_(w_hh, h_prev)  # (4H, B) += W_hh h
        ifo.sigmoid_()
        g.tanh_()
        mul(f, c_prev, out=c)  # c' = f ⊙ c + i ⊙ g
        c.addcmul_(i, g)
        tanh(c, out=m)  # m = o ⊙ tanh(c')
        m.mul_(o)
        if w_hr is not None:
            mm(w_hr, m, out=h)  # (P, B) = W_hr m
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
    steps = zip(
        _views(xw[:, : 2 * H], s, sizes), _views(xw[:, :H], s, sizes),
        _views(xw[:, H : 2 * H], s, sizes), _views(xw[:, 2 * H :], s, sizes),
        hhs, [v[: 2 * H] for v in hhs], [v[2 * H :] for v in hhs],
        _prev(h_buf, h0, s, sizes), _views(h_buf, s, sizes), strict=True,
    )
    w_hh, b_h, addmm, mm, sub = w.w_hh, w.b_h, torch.addmm, torch.mm, torch.sub
    for rz, r, z, n, hh_t, hh_rz, hh_n, h_prev, h in steps:
        if b_h is None:
            mm(w_hh, h_prev, out=hh_t)
        else:
            addmm(b_h, w_hh, h_prev, out=hh_t)  # (3H, B)
        rz.add_(hh_rz).sigmoid_()
        hh_n.mul_(r)
        n.add_(hh_n).tanh_()
        sub(h_prev, n, out=h)  # h' = (h - n) ⊙ z + n
        h.mul_(z).add_(n)
    _zero_padding([xw, h_buf], s)
    return {"r": xw[:, :H], "z": xw[:, H : 2 * H], "n": xw[:, 2 * H :], "h": h_buf}


def run_rnn(xw: Tensor, w: LayerWeights, h0: Tensor, s: Schedule, h_buf: Tensor,
            relu: bool) -> dict[str, Tensor]:
    """Plain RNN: pre = W_ih x + b_ih + W_hh h + b_hh; h' = tanh(pre) or relu(pre)."""
    sizes = s.sizes
    _prefill(h_buf, h0, s)
    steps = zip(_views(xw, s, sizes), _prev(h_buf, h0, s, sizes), _views(h_buf, s, sizes),
                strict=True)
    w_hh = w.w_hh
    if relu:
        for pre, h_prev, h in steps:
            pre.addmm_(w_hh, h_prev)
            torch.clamp_min(pre, 0, out=h)  # ATen's relu is clamp_min(0)
    else:
        for pre, h_prev, h in steps:
            pre.addmm_(w_hh, h_prev)
            torch.tanh(pre, out=h)
    _zero_padding([xw, h_buf], s)
    return {"pre": xw, "h": h_buf}


@contextlib.contextmanager
def faithful_matmul(device: torch.device) -> Iterator[None]:
    """Turn TF32 off on CUDA for the duration: TF32 GEMMs are not PyTorch's float32 numerics."""
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def run_stack(module: nn.RNNBase, x: Tensor, h0: Tensor, c0: Tensor | None,
              lengths: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """Every layer and direction of ``module`` on ``x`` (T, F, B) from states (L*D, ·, B).

    Returns the signal buffers by trace name, each (T, R, B), and h_n (L*D, H_out, B),
    c_n (L*D, H, B) or None. Dropout between layers is not applied (inference).
    """
    cell = CELL_OF_MODE[module.mode]
    D = 2 if module.bidirectional else 1
    T, _, B = x.shape
    H, P = module.hidden_size, getattr(module, "proj_size", 0)
    H_out = P or H
    G = {"lstm": 4, "gru": 3}.get(cell, 1) * H
    bufs: dict[str, Tensor] = {}
    h_n, c_n = [], []
    for layer in range(module.num_layers):
        # Both directions write their h side by side: the next layer's input, (T, D*H_out, B).
        h_cat = x.new_empty(T, D * H_out, B)
        for d in range(D):
            reverse = d == 1
            w = layer_weights(module, cell, layer, reverse)
            s = Schedule(T, reverse, lengths)
            k = layer * D + d
            xw = project(w, x, x.new_empty(T, G, B))  # (T, G, B)
            h_buf = h_cat[:, d * H_out : (d + 1) * H_out]  # (T, H_out, B)
            if cell == "lstm":
                sig = run_lstm(xw, w, h0[k], c0[k], s, h_buf)
                c_n.append(_final(sig["c"], s))
            elif cell == "gru":
                sig = run_gru(xw, w, h0[k], s, h_buf)
            else:
                sig = run_rnn(xw, w, h0[k], s, h_buf, relu=cell == "rnn_relu")
            h_n.append(_final(h_buf, s))
            prefix = f"layer{layer}{'.reverse' if reverse else ''}."
            bufs.update({prefix + name: t for name, t in sig.items()})
        x = h_cat
    return bufs, torch.stack(h_n), (torch.stack(c_n) if c_n else None)


def copy_layers(module: nn.RNNBase, start: int, count: int, batch_first: bool) -> nn.RNNBase:
    """A fresh module of the same class (eval) holding copies of layers start … start+count−1.

    The user's module is only read; verification and the parallel path run the copy.
    """
    kw = dict(num_layers=count, bias=module.bias, batch_first=batch_first,
              bidirectional=module.bidirectional)
    if isinstance(module, nn.LSTM):
        kw["proj_size"] = module.proj_size
    if isinstance(module, nn.RNN):
        kw["nonlinearity"] = module.nonlinearity
    w = getattr(module, f"weight_ih_l{start}")
    fresh = type(module)(w.shape[1], module.hidden_size, **kw).to(w.device, w.dtype).eval()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            k = int(re.search(r"_l(\d+)", name).group(1))
            p.copy_(getattr(module, re.sub(r"_l\d+", f"_l{start + k}", name, count=1)))
    return fresh


def output_batch_first(module: nn.RNNBase, output: tuple) -> tuple[Tensor, Tensor, Tensor | None]:
    """A module's (output, state) as output (B, T, D*H_out), h_n and c_n (None but LSTM)."""
    out, hn = output
    if isinstance(out, PackedSequence):
        out, _ = pad_packed_sequence(out, batch_first=True)
    elif out.ndim == 2:  # unbatched
        out = out.unsqueeze(0)
    elif not module.batch_first:
        out = out.transpose(0, 1)
    h_n, c_n = hn if isinstance(hn, tuple) else (hn, None)
    return out, h_n, c_n


def run_stack_parallel(module: nn.RNNBase, x: Tensor, h0: Tensor,
                       c0: Tensor | None) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """Like ``run_stack`` (unpacked input), but the gates of all T steps come from one large
    GEMM on the h sequence PyTorch's own kernel computes; only the LSTM's c is sequential.

    For GPUs, where T small GEMMs waste the device. Same layouts as ``run_stack``.
    """
    cell = CELL_OF_MODE[module.mode]
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
