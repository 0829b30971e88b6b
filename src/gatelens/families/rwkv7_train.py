"""What ``gatelens train --cell rwkv7`` trains: RWKV-7 "Goose" (x070) as a batched,
differentiable PyTorch module whose weights are the ``rwkv`` package's own checkpoint
layout (BlinkDL's RWKV-LM names and shapes: ``emb.weight``, ``blocks.0.ln0``,
``blocks.k.att.x_r`` (1, 1, C), ``blocks.k.att.r_k`` (H, N), ``key.weight`` as nn.Linear
holds it ...), analysed through the package's own model built from those weights.

Why not the package's model itself: ``rwkv.model.RWKV_x070`` (0.8.32) keeps its weights in a
plain dict ``z`` (no parameters), runs ``forward`` / ``forward_seq`` under ``torch.no_grad``,
reads one sequence at a time, and its whole-window time mix writes each token's output in
place into a tensor its token-shift products saved for the backward pass (autograd refuses:
"modified by an inplace operation"). Only its one-token ``RWKV_x070_TMix_one`` is
differentiable, one token of one window per call. So the module below computes what the
package computes, as RWKV-LM's trainer writes it (the same formulas in the same order:
token shift, the six mixes, w = exp(−0.606531 σ(w0 + tanh(x_w W1) W2)), a, the value
residual to layer 0's v, kk, k ← k (1 + (a − 1) k_a), S ← S (diag w − kk (kk ⊙ a)ᵀ) + v kᵀ,
GroupNorm per head, the r·k·r_k bonus, the gate g, then the squared-ReLU channel mix),
batched, with autograd. ``RWKV7Trainable.rwkv`` is the package's ``RWKV_x070`` built by
the package from these weights (written as a ``.pth`` of tensors in a temporary directory
and loaded by its own ``torch.load``: gatelens's own file, never a user's), and that is what
the RWKV-7 family reads, steps and verifies: the trace, the one-step check and the dynamics
of a trained run are the package's (tests/test_rwkv7_train.py holds the two forwards
together: 1.3e-06 on the logits' scale).

The initialisation is RWKV-LM's for RWKV-7 (its ``rwkv7_train_simplified.py``): token-shift
mixes 1 − (c/C)^(p·(1 − k/L)), the decay w0 from −6 to 0 across channels plus a zig-zag
within each head, a0 −0.19 (+ zig-zag and slope), v0 0.73, k_k 0.71, k_a 1.02, r_k −0.04,
every LoRA's first matrix 0 and its second orthogonal × 0.1, receptance ±0.5/√C, key
±0.05/√C, value ±0.5/√C, the output and the channel mix's value 0, its key orthogonal × 2.
LoRA widths follow RWKV-LM's rule max(32, round(k√C / 32)·32): k = 2.5 for w and a, 1.7 for
the value residual, 5 for the gate (``lora_widths``). The embedding and the head (no bias,
as the package's ``x @ head.weight``) keep PyTorch's initialisation.

>>> lora_widths(128), lora_widths(768)
((32, 32, 32, 64), (64, 64, 32, 128))
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import tempfile
import warnings
from importlib import import_module
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.recipe import Recipe

#: the package's constant in w = exp(−0.606531 σ(·)) (≈ e^{−1/2}, as written there)
W_SCALE = 0.606531
#: the package's GroupNorm ε of the read-out (64e-5)
GN_EPS = 64e-5


def lora_widths(C: int) -> tuple[int, int, int, int]:
    """RWKV-LM's LoRA widths (decay w, in-context rate a, value residual v, gate g) at
    width C: max(32, round(k√C / 32)·32), k = 2.5, 2.5, 1.7, 5."""
    return tuple(max(32, int(round(k * math.sqrt(C) / 32)) * 32)  # type: ignore[return-value]
                 for k in (2.5, 2.5, 1.7, 5.0))


def rwkv7_package() -> ModuleType:
    """``rwkv.model`` with RWKV-7 defined (it reads ``RWKV_V7_ON=1`` at import time, so the
    variable is set here first); a one-line error when it was imported without it."""
    if "rwkv.model" not in sys.modules:
        os.environ["RWKV_V7_ON"] = "1"
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit, the package's
        pkg = import_module("rwkv.model")
    if not hasattr(pkg, "RWKV_x070"):
        raise GatelensError("rwkv7: rwkv.model was imported without RWKV_V7_ON=1, so it has "
                            "no RWKV_x070; set RWKV_V7_ON=1 before importing it")
    return pkg


def _orthogonal(w: Tensor, gain: float) -> None:
    if not w.is_meta:  # parameter counts build on the meta device: no values to set
        nn.init.orthogonal_(w, gain=gain)


class TimeMix(nn.Module):
    """Layer k's time mix (attention-free "att"), its parameters named as the package's."""

    def __init__(self, C: int, N: int, k: int, layers: int) -> None:
        super().__init__()
        self.k, self.H, self.N = k, C // N, N
        dw, da, dv, dg = lora_widths(C)
        c = torch.arange(C, dtype=torch.float32)
        up = k / max(1, layers - 1)  # 0 at the bottom layer, 1 at the top
        down = 1.0 - k / layers  # 1 at the bottom, 1/L at the top
        linear = c / max(1, C - 1) - 0.5
        zig = ((c % N) - (N - 1) / 2) / max(1.0, (N - 1) / 2)
        zig = zig * zig.abs()
        frac = (c / C).view(1, 1, C)
        for name, p in zip("rwkvag", (0.2, 0.9, 0.7, 0.7, 0.9, 0.2), strict=True):
            setattr(self, f"x_{name}", nn.Parameter(1.0 - frac ** (p * down)))
        decay = -6 + 6 * (c / max(1, C - 1)) ** (1 + up ** 0.3)
        self.w0 = nn.Parameter((decay + 0.5 + 2.5 * zig).view(1, 1, C))
        self.w1, self.w2 = self._lora(C, dw)
        self.a0 = nn.Parameter((-0.19 + 0.3 * zig + 0.4 * linear).view(1, 1, C))
        self.a1, self.a2 = self._lora(C, da)
        if k > 0:  # layer 0's v is v_first itself: no residual (the package ignores v0..v2)
            self.v0 = nn.Parameter((0.73 - 0.4 * linear).view(1, 1, C))
            self.v1, self.v2 = self._lora(C, dv)
        self.g1, self.g2 = self._lora(C, dg)
        self.k_k = nn.Parameter((0.71 - 0.1 * linear).view(1, 1, C))
        self.k_a = nn.Parameter(torch.full((1, 1, C), 1.02))
        self.r_k = nn.Parameter(torch.full((self.H, N), -0.04))
        self.receptance, self.key, self.value, self.output = (
            nn.Linear(C, C, bias=False) for _ in range(4))
        self.ln_x = nn.GroupNorm(self.H, C, eps=GN_EPS)
        with torch.no_grad():
            for lin, s in ((self.receptance, 0.5), (self.key, 0.05), (self.value, 0.5)):
                lin.weight.uniform_(-s / math.sqrt(C), s / math.sqrt(C))
            self.output.weight.zero_()

    @staticmethod
    def _lora(C: int, D: int) -> tuple[nn.Parameter, nn.Parameter]:
        first, second = torch.zeros(C, D), torch.empty(D, C)
        _orthogonal(second, 0.1 * math.sqrt(max(1.0, D / C)))  # RWKV-LM's ortho_init
        return nn.Parameter(first), nn.Parameter(second)

    def forward(self, x: Tensor, v_first: Tensor | None) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        H, N = self.H, self.N
        xx = F.pad(x, (0, 0, 1, -1)) - x  # token shift: x_{t−1} − x_t, zeros before t = 0
        xr, xw, xk, xv, xa, xg = (x + xx * getattr(self, f"x_{n}") for n in "rwkvag")
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)  # (B, T, C) each
        w = torch.exp(-W_SCALE * torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2))
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)  # in-context rate
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, p=2.0).view(B, T, C)
        k = k * (1 + (a - 1) * self.k_a)
        if self.k == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)
        S = x.new_zeros(B, H, N, N)  # value × key per head
        # per step only what needs S_{t−1}: one product and two fused multiply-adds; the
        # steps' inputs unbound once (indexing [:, t] would cost a (B, T, C) gradient each)
        ws = w.view(B, T, H, 1, N).unbind(1)
        kks = kk.view(B, T, H, N, 1).unbind(1)
        kas = (kk * a).view(B, T, H, 1, N).unbind(1)
        vks = (v.view(B, T, H, N, 1) * k.view(B, T, H, 1, N)).unbind(1)  # v kᵀ
        states = []
        for t in range(T):  # S ← S (diag w − kk (kk ⊙ a)ᵀ) + v kᵀ
            S = torch.addcmul(torch.addcmul(vks[t], S, ws[t]), S @ kks[t], kas[t], value=-1.0)
            states.append(S)
        o = torch.stack(states, 1) @ r.view(B, T, H, N, 1)  # S_t r_t, (B, T, H, N, 1)
        o = self.ln_x(o.view(B * T, C)).view(B, T, C)
        bonus = (r * k * self.r_k.view(C)).view(B, T, H, N).sum(-1, keepdim=True)  # (B,T,H,1)
        o = o + (bonus * v.view(B, T, H, N)).view(B, T, C)
        return self.output(o * g), v_first


class ChannelMix(nn.Module):
    """Layer k's channel mix ("ffn"): relu(W_k mix(x))² then W_v, with its token shift."""

    def __init__(self, C: int) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(1, 1, C))
        self.key, self.value = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)
        with torch.no_grad():
            _orthogonal(self.key.weight, 2.0)
            self.value.weight.zero_()

    def forward(self, x: Tensor) -> Tensor:
        x = x + (F.pad(x, (0, 0, 1, -1)) - x) * self.x_k
        return self.value(torch.relu(self.key(x)) ** 2)


class Block(nn.Module):
    """One RWKV-7 block: ln1, time mix, ln2, channel mix (and ln0 on the embedding at 0)."""

    def __init__(self, C: int, N: int, k: int, layers: int) -> None:
        super().__init__()
        if k == 0:
            self.ln0 = nn.LayerNorm(C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.att, self.ffn = TimeMix(C, N, k, layers), ChannelMix(C)


class RWKV7Trainable(nn.Module):
    """RWKV-7 as a language model of ids, trainable: (B, T) int64 -> logits (B, T, V),
    every window from the zero state. Its ``state_dict`` is the package's checkpoint layout;
    ``rwkv`` is the package's own ``RWKV_x070`` built from the current weights (rebuilt
    whenever a parameter changed), which the RWKV-7 family opens and verifies against."""

    def __init__(self, vocab_size: int, hidden: int, layers: int, head_size: int) -> None:
        super().__init__()
        if hidden % head_size:
            raise GatelensError(f"rwkv7: --hidden {hidden} must be a multiple of the head "
                                f"size {head_size}")
        self.emb = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(Block(hidden, head_size, k, layers) for k in range(layers))
        self.ln_out = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.emb.num_embeddings

    def forward(self, ids: Tensor) -> Tensor:
        x = self.blocks[0].ln0(self.emb(ids))  # (B, T, C)
        v_first = None
        for blk in self.blocks:
            y, v_first = blk.att(blk.ln1(x), v_first)
            x = x + y
            x = x + blk.ffn(blk.ln2(x))
        return self.head(self.ln_out(x))  # (B, T, V)

    @property
    def rwkv(self) -> nn.Module:
        """The package's ``RWKV_x070`` ("cpu fp32") built by the package from these weights."""
        version = tuple((id(p), p._version) for p in self.parameters())
        cached = self.__dict__.get("_package")
        if cached is None or cached[0] != version:
            cached = (version, _package_model(self.state_dict()))
            self.__dict__["_package"] = cached  # not a submodule: opened once, as this
        return cached[1]

    def __getstate__(self) -> dict:  # a copy rebuilds the package's model when read
        state = dict(super().__getstate__())
        state.pop("_package", None)
        return state


def _package_model(weights: dict[str, Tensor]) -> nn.Module:
    """The package's ``RWKV_x070`` as the package itself loads ``weights`` (a ``.pth`` of
    tensors gatelens writes for it in a temporary directory)."""
    pkg = rwkv7_package()
    tensors = {n: t.detach().to("cpu", torch.float32).clone() for n, t in weights.items()}
    # the package memory-maps the file; an open map outlives the file's removal (POSIX)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as d:
        path = os.path.join(d, "rwkv7")
        torch.save(tensors, path + ".pth")
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return pkg.RWKV_x070(path, "cpu fp32")


def _build(n_in: int, hidden: int, layers: int, *, settings: dict, **_: object) -> nn.Module:
    return RWKV7Trainable(n_in, hidden, layers, settings["head_size"])


#: ``--cell rwkv7``: heads of 16 channels (RWKV-LM's own small demo; its LMs use 64)
RWKV7_RECIPE = Recipe(
    "rwkv7", "RWKV-7 (x070), trained in PyTorch in the rwkv package's layout, analysed "
    "through its RWKV_x070", _build, reads="lm", flags=frozenset(),
    package=("rwkv", "rwkv"), settings={"head_size": 16},
    multiple=lambda heads: 16, keep_words="RWKV-7 decay w")
