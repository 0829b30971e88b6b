"""RWKV-7 read in ONE whole-window pass per layer, in the ``rwkv`` package's own arithmetic.

The package's whole-window forward (``forward_seq``; its CPU time mix ``RWKV_x070_TMix_seq``)
forms r, w, k, v, a, g and kk for every token with one product each, then loops over t for
the state update only: ``state = state * w_.view(H,1,N) + state @ ab.float() + vk.float()``.
Its functions are ``torch.jit``-scripted module-level functions (no hook reaches inside them)
and it takes one sequence per call, so the per-token states it holds never leave it.
``time_mix_scan`` and ``channel_mix_scan`` are those two functions as the package writes
them (the same expressions in the same order: the token shift, the six mixes, the
projections, normalize, w = exp(−0.606531·σ(·)) in float, the per-t update) on B windows:
what the package does for all T tokens at once runs a window at a time on its own shapes
(``windows``), the per-t update on all B windows at once, S kept after every token;
``scan_model`` is ``forward_seq`` (full output) on top of them. In float32 its logits and
final state are ``forward_seq``'s bit for bit (tests/test_rwkv7_scan.py, which also holds
every state against the package's one-token path: within float32 rounding, as that path's
one-row projections round differently).

The same functions run in float64 on a float64 copy of the weights for the family's
free-running re-run (``scan_block``, a layer at a time): one pass per layer instead of T·L
hand-cell steps. The state's dtype is float32 wherever the package's is (its ``.float()``),
float64 in float64.

>>> x = torch.ones(3, 2)  # (T, C): the token shift is x_{t−1} − x_t, zeros before t = 0
>>> token_shift(x)[:, 0].tolist()
[-1.0, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gatelens.families.buffers import state_empty
from gatelens.families.rwkv7_train import GN_EPS, W_SCALE

__all__ = ["channel_mix_scan", "scan_block", "scan_model", "time_mix_scan", "token_shift",
           "windows"]

#: what ``time_mix_scan`` takes after (layer, H, N, x, v_first), by key of ``z`` (the
#: package's ``RWKV_x070_TMix_seq`` arguments after its x_prev and state, in its order)
TMIX = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "w1", "w2", "a0", "a1", "a2", "v0",
        "v1", "v2", "g1", "g2", "k_k", "k_a", "r_k", "receptance.weight", "key.weight",
        "value.weight", "output.weight", "ln_x.weight", "ln_x.bias")


def token_shift(x: Tensor) -> Tensor:
    """x_{t−1} − x_t over one window (T, C) from the zero x_prev: the package's
    ``torch.cat((x_prev.unsqueeze(0), x[:-1,:])) - x``."""
    return torch.cat((x.new_zeros(1, x.shape[1]), x[:-1])) - x


def windows(fn: Callable[..., Any], *xs: Tensor | None) -> Any:
    """``fn`` on each window's rows (T, ·) of the (B, T, ·) tensors ``xs``, its results
    stacked (B, T, ·): every product and every σ, tanh, exp and norm on the package's own
    shapes. Over all B·T rows at once some round differently (a BLAS kernel chosen by the
    row count; a vectorised σ whose lanes fall on other elements: seen at a LoRA width of
    4, B·T = 51), and forward_seq is matched bit for bit."""
    B = next(x for x in xs if x is not None).shape[0]
    got = [fn(*(None if x is None else x[b] for x in xs)) for b in range(B)]
    if isinstance(got[0], Tensor):
        return torch.stack(got)
    return tuple(torch.stack(parts) for parts in zip(*got, strict=True))


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    # the package holds S in float32 (``.float()``) whatever its weights; float64 stays
    return torch.promote_types(dtype, torch.float32)


def _time_mix_in(layer_id: int, H: int, N: int, x: Tensor, v_first: Tensor | None,
                 w: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``RWKV_x070_TMix_seq`` up to its loop, on one window x (T, C), as it writes it:
    r, w (float), k (the written key), v (after the value residual), a, g, kk."""
    (x_r, x_w, x_k, x_v, x_a, x_g, w0, w1, w2, a0, a1, a2, v0, v1, v2, g1, g2, k_k, k_a,
     _, R_, K_, V_, _, _, _) = w
    T = x.shape[0]
    xx = token_shift(x)
    xr, xw, xk, xv, xa, xg = (x + xx * x_r, x + xx * x_w, x + xx * x_k, x + xx * x_v,
                              x + xx * x_a, x + xx * x_g)
    r = xr @ R_
    wd = torch.tanh(xw @ w1) @ w2
    k = xk @ K_
    v = xv @ V_
    a = torch.sigmoid(a0 + (xa @ a1) @ a2)
    g = torch.sigmoid(xg @ g1) @ g2
    kk = F.normalize((k * k_k).view(T, H, N), dim=-1, p=2.0).view(T, H * N)
    k = k * (1 + (a - 1) * k_a)
    if layer_id != 0:
        v = v + (v_first - v) * torch.sigmoid(v0 + (xv @ v1) @ v2)
    wd = torch.exp(-W_SCALE * torch.sigmoid((w0 + wd).to(_state_dtype(x.dtype))))
    return r, wd, k, v, a, g, kk


def _time_mix_out(H: int, N: int, xx: Tensor, r: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  w: tuple[Tensor, ...]) -> Tensor:
    """``RWKV_x070_TMix_seq`` after its loop, on one window: xx (T, C) the S_t r_t."""
    T = xx.shape[0]
    *_, r_k, _, _, _, O_, ln_w, ln_b = w
    xx = F.group_norm(xx, num_groups=H, weight=ln_w, bias=ln_b, eps=GN_EPS).view(T, H * N)
    xx = xx + ((r * k * r_k).view(T, H, N).sum(dim=-1, keepdim=True)
               * v.view(T, H, N)).view(T, H * N)
    return (xx * g) @ O_


@torch.no_grad()
def time_mix_scan(layer_id: int, H: int, N: int, x: Tensor, v_first: Tensor | None,
                  *w: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """The package's ``RWKV_x070_TMix_seq`` (its CPU branch) on B windows from the zero
    state: x (B, T, C), the layer's ln1 output; ``w`` its 26 tensors in ``TMIX``'s order.
    Every token's r, w, k, v, a, g, kk a window at a time (``windows``), then the per-t
    update on all B windows at once. Returns the time mix's output (B, T, C), the signals
    {r, w, k, v, a, kk} as it forms them (k the written key; v after the value residual;
    "v_first": layer 0's v) and S after every token (B, T, H, N, N), value × key, in the
    state's dtype."""
    B, T, C = x.shape
    r, wd, k, v, a, g, kk = windows(
        lambda xb, fb: _time_mix_in(layer_id, H, N, xb, fb, w), x, v_first)
    v_first = v if layer_id == 0 else v_first
    acc = _state_dtype(x.dtype)

    # time leads, so each step's slice is contiguous, as the package's [t] rows are
    def by_t(y: Tensor, *shape: int) -> Tensor:
        return y.transpose(0, 1).reshape(T, B, H, *shape)

    vs, ks, kks, kas = by_t(v, N, 1), by_t(k, 1, N), by_t(-kk, N, 1), by_t(kk * a, 1, N)
    ws, rs = by_t(wd, 1, N), by_t(r, N, 1)
    # S after every token is written once into its place; the step itself runs in two
    # buffers that stay in cache (fresh tensors a step would each be new memory)
    states = state_empty((B, T, H, N, N), acc, x.device)
    out = torch.empty(B, T, H, N, 1, dtype=x.dtype, device=x.device)
    prev, cur = (torch.zeros(B, H, N, N, dtype=acc, device=x.device) for _ in range(2))
    vk, ab = (torch.empty(B, H, N, N, dtype=x.dtype, device=x.device) for _ in range(2))
    kept, moved = torch.empty_like(prev), torch.empty_like(prev)
    for t in range(T):  # the package's step: state * w + state @ ab + vk, in that order
        torch.matmul(vs[t], ks[t], out=vk)
        torch.matmul(kks[t], kas[t], out=ab)
        torch.mul(prev, ws[t], out=kept)
        torch.matmul(prev, ab.to(acc), out=moved)
        torch.add(kept, moved, out=cur)
        cur.add_(vk.to(acc))
        states[:, t] = cur
        out[:, t] = cur.to(dtype=x.dtype) @ rs[t]
        prev, cur = cur, prev
    o = windows(lambda ob, rb, kb, vb, gb: _time_mix_out(H, N, ob, rb, kb, vb, gb, w),
                out.view(B, T, C), r, k, v, g)
    sig = {"r": r, "w": wd, "k": k, "v": v, "a": a, "kk": kk, "v_first": v_first}
    return o, sig, states


def _channel_mix(x: Tensor, x_k: Tensor, K_: Tensor, V_: Tensor) -> Tensor:
    """The package's ``RWKV_x070_CMix_seq`` on one window (T, C) from the zero x_prev."""
    k = x + token_shift(x) * x_k
    k = torch.relu(k @ K_) ** 2
    return k @ V_


@torch.no_grad()
def channel_mix_scan(x: Tensor, x_k: Tensor, K_: Tensor, V_: Tensor) -> Tensor:
    """The package's ``RWKV_x070_CMix_seq`` on B windows (B, T, C), a window at a time."""
    return windows(lambda xb: _channel_mix(xb, x_k, K_, V_), x)


@torch.no_grad()
def scan_block(k: int, z: dict[str, Tensor], H: int, N: int, x: Tensor,
               v_first: Tensor | None) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
    """Block k of ``forward_seq`` on B windows: its ln1 and ln2 outputs, time mix, channel
    mix and residuals. Returns (signals with "v_first", [ln1 out, S (B, T, H·N·N), ln2 out]
    (the carried parts after every token), the block's output), each (B, T, ·)."""
    B, T, C = x.shape
    blk, att, ffn = f"blocks.{k}.", f"blocks.{k}.att.", f"blocks.{k}.ffn."

    def norm(y: Tensor, name: str) -> Tensor:
        return windows(lambda yb: F.layer_norm(yb, (C,), weight=z[blk + name + ".weight"],
                                               bias=z[blk + name + ".bias"]), y)

    xx = norm(x, "ln1")
    o, sig, S = time_mix_scan(k, H, N, xx, v_first, *(z[att + n] for n in TMIX))
    x = x + o
    ff = norm(x, "ln2")
    x = x + channel_mix_scan(ff, z[ffn + "x_k"], z[ffn + "key.weight"], z[ffn + "value.weight"])
    return sig, [xx, S.reshape(B, T, -1), ff], x


@torch.no_grad()
def scan_model(z: dict[str, Tensor], H: int, N: int, layers: int, x: Tensor) -> dict:
    """``forward_seq(ids, zero state, full_output=True)`` on B windows, from their
    embeddings x = ``z["emb.weight"][ids]`` (B, T, C): {"x": each block's input, "xo": its
    output, "sig": its signals, "parts": its carried parts after every token, "output":
    the logits (B, T, V)}, lists per layer."""
    C = x.shape[-1]
    got: dict[str, list] = {n: [] for n in ("x", "xo", "sig", "parts")}
    v_first = None
    for k in range(layers):
        got["x"].append(x)
        sig, parts, x = scan_block(k, z, H, N, x, v_first)
        v_first = sig["v_first"]
        got["sig"].append(sig)
        got["parts"].append(parts)
        got["xo"].append(x)
    out = windows(lambda xb: F.layer_norm(xb, (C,), weight=z["ln_out.weight"],
                                          bias=z["ln_out.bias"]) @ z["head.weight"], x)
    return {**got, "output": out}
