"""NX-AI's ``xlstm`` (2.0.6): an ``xLSTMBlockStack`` of mLSTM blocks (also inside
``xLSTMLMModel``), its matrix memory replayed step by step.

The layer (``mLSTMLayer``): x_m, z = proj_up(u); x̂ = silu(causal conv(x_m)); q, k = the
head-wise projections of x̂, v of x_m; the gate pre-activations ĩ, f̃ (one per head) from
``igate``/``fgate`` (``nn.Linear``) on [q, k, v]. Per head the package's recurrent form
(``recurrent_step_stabilized_simple``), with k̄ = k/√d:
  m' = max(ln σ(f̃) + m, ĩ),  C' = f C + i v k̄ᵀ (stored k̄ vᵀ),  n' = f n + i k̄,
  h̃ = (qᵀ C') / (max(|qᵀ n'|, e^{−m'}) + ε),  f = e^{ln σ(f̃) + m − m'}, i = e^{ĩ − m'};
then h = GroupNorm per head(h̃) + skip ⊙ x̂, times silu(z), and ``proj_down``.
The carried state here is the memory in the raw scale, C̄ = e^{m} C and n̄ = e^{m} n,
which no stabiliser touches: C̄' = σ(f̃) C̄ + e^{ĩ} k̄ vᵀ, n̄' = σ(f̃) n̄ + e^{ĩ} k̄, and
h̃ = qᵀ C̄' / (max(|qᵀ n̄'|, 1) + ε e^{m'}); so the keep factor is the head's raw σ(f̃), one per
head for all of its d² + d memory entries (units: the heads). m enters only through ε; the
read-out and the dynamics take it from the module's own trajectory (``aux``), so it is no
direction of the dynamics. The trace's i is the stabilised e^{ĩ − m'}.

The module's own trajectory: its whole-sequence forward, the memory the package's own step
function (``mLSTMCell.backend_fn_step``, whose memory starts at C = n = 0 with m = 0, as the
package writes it) replayed on the q, k, v, ĩ, f̃ the forward formed
(families/xlstm_stack_scan.py). The parallel forward normalises by the row-wise maximum,
the step by m: the same in exact arithmetic but for where ε enters, so the two h part by
rounding (``step_vs_forward``). The stack's ``step`` path is the tests' independent
per-token reference.
xlstm initialises the gate weights at zero: ``tiny_mlstm_stack`` randomises them.

>>> import torch
>>> fam = XLSTMMLSTMFamily(tiny_mlstm_stack())
>>> call = fam.check(torch.randn(2, 6, 8))
>>> max(d.max_scaled_diff_h for d in fam.one_step(call, fam.reference(call))) < 1e-5
True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.families.buffers import joined, zeros64
from gatelens.families.delta_edit import no_edit
from gatelens.families.official import buffer_units
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, CellSpec
from gatelens.families.xlstm_slstm import XLSTMStack, xlstm_stack

XLSTM_MLSTM = CellSpec(
    name="xlstm_mlstm", kind="xlstm", chunks=("i", "f"),
    signals=("i", "f", "s", "h", "y"), gates=("i", "f"), keep_gate="f", input_gate="i",
    state="s", bounds={"i": SIGMOID, "f": SIGMOID},
    display={"f": "forget σ(f̃) per head", "i": "input exp(ĩ − m') per head",
             "s": "memory (C, n)·e^m per head"})


def mlstm_block(settings: dict, heads: int) -> object:
    """xlstm's mLSTMBlockConfig of a recipe's ``settings`` (conv, qkv blocks, proj factor)."""
    import xlstm

    s = settings
    return xlstm.mLSTMBlockConfig(mlstm=xlstm.mLSTMLayerConfig(
        conv1d_kernel_size=s["conv1d_kernel_size"], num_heads=heads,
        qkv_proj_blocksize=s["qkv_proj_blocksize"], proj_factor=s["proj_factor"]))


def _build_mlstm(n_in: int, hidden: int, layers: int, *, heads: int = 1, settings: dict,
                 **_: object) -> nn.Module:
    block = {"mlstm_block": mlstm_block(settings, heads), "slstm_at": []}
    return xlstm_stack(block, hidden, layers, settings["context_length"])


#: ``--cell xlstm-mlstm``: proj 2, conv 4, qkv blocks 4; --hidden a multiple of what its
#: inner 2 d needs (heads, and qkv blocks of 4)
MLSTM_RECIPE = Recipe(
    "xlstm-mlstm", "xlstm's xLSTMBlockStack of mLSTM blocks (--heads)", _build_mlstm,
    reads="embedded", flags=frozenset({"heads"}), package=("xlstm", "xlstm"),
    settings={"conv1d_kernel_size": 4, "qkv_proj_blocksize": 4, "proj_factor": 2.0,
              "context_length": 2048},
    multiple=lambda heads: math.lcm(2, heads // math.gcd(heads, 2)),
    keep_words="xlstm's mLSTM the head's raw f")

EPS = 1e-6  # the package's ε in recurrent_step_stabilized_simple


def tiny_mlstm_stack(dim: int = 8, blocks: int = 1, heads: int = 2, conv: int = 2,
                     context: int = 32) -> nn.Module:
    """A small random xLSTMBlockStack of mLSTM blocks with its gate weights randomised
    (xlstm initialises them at zero)."""
    from xlstm import mLSTMBlockConfig, mLSTMLayerConfig, xLSTMBlockStack, xLSTMBlockStackConfig

    layer = mLSTMLayerConfig(conv1d_kernel_size=conv, qkv_proj_blocksize=2, num_heads=heads)
    cfg = xLSTMBlockStackConfig(mlstm_block=mLSTMBlockConfig(mlstm=layer),
                                context_length=context, num_blocks=blocks, embedding_dim=dim)
    stack = xLSTMBlockStack(cfg)
    with torch.no_grad():
        for block in stack.blocks:
            cell = block.xlstm.mlstm_cell
            for gate in (cell.igate, cell.fgate):
                gate.weight.normal_(0.0, 0.3)
            cell.igate.bias.normal_(0.0, 1.0)
    return stack.eval()


class XLSTMMLSTMFamily(XLSTMStack):
    """xlstm's xLSTMBlockStack of mLSTM blocks."""

    name = "xlstm-mlstm"
    opens_what = "xlstm's xLSTMBlockStack / xLSTMLMModel of mLSTM blocks (NX-AI, 2.0.6)"
    cell_name = "xlstm_mlstm"
    kind = "mLSTMLayer"
    specs = (XLSTM_MLSTM,)
    recipe = MLSTM_RECIPE
    units_name = "head"
    #: the memory on its raw scale, e^m C, passes float32's range once the stabiliser m
    #: passes 88 (a large input gate): it is read and traced in float64
    state_dtype = torch.float64

    @property
    def heads(self) -> int:
        return int(self.layers[0].mlstm_cell.config.num_heads)

    @property
    def inner(self) -> int:
        return int(self.layers[0].config._inner_embedding_dim)

    @property
    def head_dim(self) -> int:
        return self.inner // self.heads

    @property
    def hidden_size(self) -> int:
        return self.heads

    def state_units(self, k: int) -> Tensor:
        d = self.head_dim
        heads = torch.arange(self.heads)
        return torch.cat([heads.repeat_interleave(d * d), heads.repeat_interleave(d)])

    def part_units(self, k: int) -> list[Tensor]:
        u, dd = self.state_units(k), self.heads * self.head_dim ** 2
        return [buffer_units(self.conv_width, self.inner), u[:dd], u[dd:]]

    def _step_state(self, k, st, B):
        c, n, m = st["mlstm_state"]  # (B, NH, d, d), (B, NH, d, 1), (B, NH, 1, 1)
        scale = torch.exp(m.double())
        return self._buffer(st, B) + [(c * scale).reshape(B, -1), (n * scale).reshape(B, -1),
                                      m.reshape(B, -1)]

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        NH, d = self.heads, self.head_dim
        return zeros64(self.module, batch, (self.conv_width - 1) * self.inner, NH * d * d, NH * d)

    def initial_stabiliser(self, k: int, batch: int) -> Tensor:
        """The package's m before the first step (its step path starts at m = 0)."""
        return zeros64(self.module, batch, self.heads)[0]

    def step_cell(self, k, m, u, parts, aux, edit=no_edit, prev=None):
        """One step; ``prev`` (an edited run): the stabiliser m before the step, from which
        m' is computed as the package does (returned as ``sig["m"]``), else ``aux`` is m'."""
        layer = m.blocks[k].xlstm
        cell = layer.mlstm_cell
        buf, C, n = parts
        NH, d = self.heads, self.head_dim
        x_m, z = torch.split(layer.proj_up(u), self.inner, dim=-1)  # (R, inner) each
        xc, buf = self._conv(layer, buf, x_m)
        q, key, v = layer.q_proj(xc), layer.k_proj(xc), layer.v_proj(x_m)
        gin = torch.cat([q, key, v], dim=-1)
        pi, pf = cell.igate(gin), cell.fgate(gin)  # (R, NH) each
        f0 = torch.sigmoid(pf)
        f = edit("f", f0)
        m_new = aux if prev is None else torch.maximum(
            (F.logsigmoid(pf) if f is f0 else torch.log(f)) + prev, pi)
        i0 = torch.exp(pi - m_new)
        i = edit("i", i0)  # the stabilised exp(ĩ − m'); an edited i is written as i · e^{m'}
        # the raw-scale memory in the dtype it is carried in (``carried_parts``: float64,
        # as e^{m} passes float32's range once m > 88), the read h̃ back in the module's
        raw = C.dtype
        q, key, v = (t.view(-1, NH, d).to(raw) for t in (q, key, v))
        kbar = key / math.sqrt(d)
        pi, m_raw = pi.to(raw), m_new.to(raw)
        ei = (torch.exp(pi) if i is i0 else i.to(raw) * torch.exp(m_raw))[..., None]
        fr = f.to(raw)
        C_new = fr[..., None, None] * C.view(-1, NH, d, d) + ei[..., None] * (
            kbar[..., :, None] * v[..., None, :])  # (R, NH, d, d): k̄ vᵀ
        n_new = fr[..., None] * n.view(-1, NH, d) + ei * kbar  # (R, NH, d)
        s_new = edit("s", torch.cat([C_new.reshape(-1, NH * d * d), n_new.reshape(-1, NH * d)],
                                    dim=-1))
        C_new, n_new = s_new[:, : NH * d * d].view(-1, NH, d, d), s_new[:, NH * d * d:].view(
            -1, NH, d)
        num = torch.einsum("rhi,rhij->rhj", q, C_new)
        qn = torch.einsum("rhi,rhi->rh", q, n_new)[..., None]
        denom = torch.maximum(qn.abs(), torch.ones_like(qn)) + EPS * torch.exp(m_raw)[..., None]
        htil = (num / denom).to(u.dtype)  # (R, NH, d)
        h = edit("h", cell.outnorm(htil[:, :, None]).transpose(1, 2).reshape(-1, self.inner))
        out = (h + layer.learnable_skip * xc) * F.silu(z)
        y = layer.proj_down(out)
        sig = {"i": i, "f": f, "h": h, "m": m_new}
        return sig, [buf, C_new.reshape(-1, NH * d * d), n_new.reshape(-1, NH * d)], y

    def carried_parts(self, k: int, parts: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
        """Block k's parts as an edited run carries them from step to step: the buffer in
        the module's ``dtype``, the raw-scale memory C̄, n̄ in float64 (e^{m} C passes
        float32's range once the stabiliser m passes 88: a large input gate)."""
        return [parts[0].to(dtype), *(p.double() for p in parts[1:])]

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return joined(parts[1:])  # (R, NH·(d² + d)): C̄ then n̄
