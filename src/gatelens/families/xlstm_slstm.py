"""NX-AI's ``xlstm`` (2.0.6): an ``xLSTMBlockStack`` of sLSTM blocks (also inside
``xLSTMLMModel``), on the CPU's vanilla backend; the stack machinery both xlstm families
share (families/xlstm_mlstm.py).

Block k: u = LN(x); x ← x + sLSTMLayer(u); x ← x + FFN(LN(x)) when it has one; the stack
ends with ``post_blocks_norm``. The layer: x̂ = silu(causal conv(u)) (when
``conv1d_kernel_size`` > 0), and the cell's pre-activations in ITS order i, f, z, o:
ĩ = ``fgate``(x̂), f̃ = ``igate``(x̂), z̃ = ``zgate``(u), õ = ``ogate``(u) (sLSTMLayer feeds its
``fgate`` module into the i slot and ``igate`` into f; read as wired), plus R h per head
(block-diagonal) and the bias. The cell (its vanilla ``slstm_forward_pointwise``):
z = tanh z̃, o = σ(õ), m' = max(ln σ(f̃) + m, ĩ) (m' = ĩ while n = 0), c' = f c + i z,
n' = f n + i, h' = o c'/n', with the stabilised i = exp(ĩ − m') and f = exp(ln σ(f̃) + m − m').
The layer's output is the per-head group norm of h. Read here as METHODS' sLSTM: the state
s = c/n, the keep κ = f n / n' (the same for the stabilised and the raw values), and the
dynamics carry (h, s, ℓ = m + ln n); the trace's f is the raw σ(f̃), never the stabilised f,
and its i the cell's stabilised exp(ĩ − m'). R and b are read in the package's external
layout (its ``_recurrent_kernel_int2ext``: (heads, d, gates, d); ``_bias_int2ext``: (heads,
gates, d)), which both backends share; ``to_vanilla`` converts a CUDA-backend stack's
cells for the CPU.

The module's own trajectory: its whole-sequence forward, each sLSTM layer's states from its
cell's own loop run again on the gates' projections the forward formed
(families/xlstm_stack_scan.py); the stack's ``step`` path (each layer's ``step``, the states
passed along, ``_trajectory``) is the independent per-token reference the tests hold them
against.

>>> import torch
>>> fam = XLSTMSLSTMFamily(tiny_slstm_stack())
>>> call = fam.check(torch.randn(2, 6, 8))
>>> max(d.max_scaled_diff_h for d in fam.one_step(call, fam.reference(call))) < 1e-5
True
"""

from __future__ import annotations

import abc
import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call
from gatelens.families.buffers import zeros64
from gatelens.families.delta_edit import StepEdits, no_edit
from gatelens.families.official import OfficialFamily, buffer_units
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, TANH, CellSpec
from gatelens.families.xlstm_stack_scan import XLSTMStackForward, _kind

XLSTM_SLSTM = CellSpec(
    name="xlstm_slstm", kind="xlstm", chunks=("i", "f", "z", "o"),
    signals=("z", "i", "f", "o", "kappa", "s", "h", "y"),
    gates=("z", "i", "f", "o", "kappa"), keep_gate="kappa", input_gate="i", state="s",
    candidate="z",
    bounds={"z": TANH, "i": SIGMOID, "f": SIGMOID, "o": SIGMOID, "kappa": SIGMOID,
            "s": TANH, "h": TANH},
    display={"kappa": "keep κ = f n / n'", "s": "state c/n", "f": "forget σ(f̃)",
             "i": "input exp(ĩ − m')"})


def xlstm_stack(block: dict, d: int, layers: int, context_length: int) -> nn.Module:
    """xlstm's xLSTMBlockStack of ``layers`` blocks of width ``d`` (``block``: its
    ``slstm_block``/``mlstm_block`` and ``slstm_at`` settings)."""
    import xlstm

    return xlstm.xLSTMBlockStack(xlstm.xLSTMBlockStackConfig(
        context_length=context_length, num_blocks=layers, embedding_dim=d, **block))


def slstm_block(settings: dict, heads: int) -> object:
    """xlstm's sLSTMBlockConfig of a recipe's ``settings`` (backend, conv, bias init, FFN)."""
    import xlstm

    s = settings
    return xlstm.sLSTMBlockConfig(
        slstm=xlstm.sLSTMLayerConfig(backend=s["backend"], num_heads=heads,
                                     conv1d_kernel_size=s["conv1d_kernel_size"],
                                     bias_init=s["bias_init"]),
        feedforward=xlstm.FeedForwardConfig(proj_factor=s["ffn_proj_factor"],
                                            act_fn=s["ffn_act_fn"]))


def _build_slstm(n_in: int, hidden: int, layers: int, *, heads: int = 1, settings: dict,
                 **_: object) -> nn.Module:
    block = {"slstm_block": slstm_block(settings, heads), "slstm_at": "all"}
    return xlstm_stack(block, hidden, layers, settings["context_length"])


#: ``--cell xlstm-slstm``: the stack between an embedding and a head; the vanilla (CPU)
#: backend, conv 4, FFN 1.3; its whole-sequence mask needs a context of 2048 characters
SLSTM_RECIPE = Recipe(
    "xlstm-slstm", "xlstm's xLSTMBlockStack of sLSTM blocks (--heads)", _build_slstm,
    reads="embedded", flags=frozenset({"heads"}), package=("xlstm", "xlstm"),
    settings={"backend": "vanilla", "conv1d_kernel_size": 4, "ffn_proj_factor": 1.3,
              "ffn_act_fn": "gelu", "bias_init": "powerlaw_blockdependent",
              "context_length": 2048},
    keep_words="xlstm's sLSTM κ = f n/n'")

_STACK = ("xlstm.xlstm_block_stack", "xLSTMBlockStack")


def tiny_slstm_stack(dim: int = 8, blocks: int = 1, heads: int = 2, conv: int = 2,
                     context: int = 32, ffn: bool = True) -> nn.Module:
    """A small random xLSTMBlockStack of sLSTM blocks on the vanilla backend, with R and
    the biases randomised (xlstm initialises R at zero)."""
    from xlstm import (
        FeedForwardConfig,
        sLSTMBlockConfig,
        sLSTMLayerConfig,
        xLSTMBlockStack,
        xLSTMBlockStackConfig,
    )

    layer = sLSTMLayerConfig(backend="vanilla", num_heads=heads, conv1d_kernel_size=conv,
                             bias_init="powerlaw_blockdependent")
    cfg = xLSTMBlockStackConfig(
        slstm_block=sLSTMBlockConfig(slstm=layer, feedforward=FeedForwardConfig(
            proj_factor=1.3, act_fn="gelu") if ffn else None),
        context_length=context, num_blocks=blocks, embedding_dim=dim, slstm_at="all")
    stack = xLSTMBlockStack(cfg)
    with torch.no_grad():
        for block in stack.blocks:
            cell = block.xlstm.slstm_cell
            cell._recurrent_kernel_.normal_(0.0, 0.5)
            cell._bias_.add_(torch.randn_like(cell._bias_))
    return stack.eval()


def to_vanilla(stack: nn.Module) -> nn.Module:
    """The stack with every CUDA-backend sLSTM cell replaced by a vanilla one holding the
    same weights (converted through the package's external layout), in place; returned."""
    from xlstm.blocks.slstm.cell import sLSTMCell_cuda, sLSTMCell_vanilla

    for block in stack.blocks:
        cell = getattr(block.xlstm, "slstm_cell", None)
        if isinstance(cell, sLSTMCell_cuda):
            cfg = copy.deepcopy(cell.config)
            cfg.backend = "vanilla"
            new = sLSTMCell_vanilla(cfg).to(cell._recurrent_kernel_.device)
            with torch.no_grad():  # through the external layout both backends share
                R = cell._recurrent_kernel_int2ext(cell._recurrent_kernel_)
                new._recurrent_kernel_.copy_(new._recurrent_kernel_ext2int(R))
                new._bias_.copy_(new._bias_ext2int(cell._bias_int2ext(cell._bias_)))
            block.xlstm.slstm_cell = new
    return stack


class XLSTMStack(XLSTMStackForward, StepEdits, OfficialFamily):
    """An xLSTMBlockStack whose blocks are all of one kind (``kind``)."""

    kind = ""
    uses_aux = True
    #: an edited run carries the package's stabiliser m itself (families/official_edit.py)
    live_aux = "stabiliser"

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        t = type(module)
        return (t.__module__, t.__name__) == _STACK and any(
            _kind(b) == cls.kind for b in module.blocks)

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        kinds = sorted({type(layer).__name__ for layer in self.layers})
        if kinds != [self.kind]:
            raise GatelensError(f"xlstm: a stack mixing {' and '.join(kinds)} blocks "
                                "(slstm_at) is not supported; open a stack of one kind")

    @property
    def layers(self) -> list[nn.Module]:
        return [b.xlstm for b in self.module.blocks]

    @property
    def num_layers(self) -> int:
        return len(self.module.blocks)

    @property
    def conv_width(self) -> int:
        return int(self.layers[0].config.conv1d_kernel_size)

    def input_window(self) -> int:
        return max(1, self.conv_width)

    def _forward(self, call: Call) -> Tensor:
        return self.module(call.inputs)

    @abc.abstractmethod
    def _step_state(self, k: int, st: dict, B: int) -> list[Tensor]:
        """The dynamic parts (B, n_i) of layer k from the layer's own step state (each
        cell's own: sLSTM's c, n, m, h; mLSTM's C, n, m)."""

    def _trajectory(self, call: Call) -> dict:
        L, B = self.num_layers, call.batch
        states: list[dict] = [{} for _ in range(L)]
        rec: dict[str, list[list[Tensor]]] = {n: [[] for _ in range(L)]
                                              for n in ("x", "u", "y", "xo")}
        parts: list[list[list[Tensor]]] = [[] for _ in range(L)]
        outs = []
        for t in range(call.length):
            x = call.inputs[:, t : t + 1]  # (B, 1, D)
            for k, block in enumerate(self.module.blocks):  # xLSTMBlock.step, kept
                u = block.xlstm_norm(x)
                y, states[k] = block.xlstm.step(u, **states[k])
                xo = x + y
                if block.ffn is not None:
                    xo = xo + block.ffn(block.ffn_norm(xo))
                for n, v in (("x", x), ("u", u), ("y", y), ("xo", xo)):
                    rec[n][k].append(v.clone())
                parts[k].append([p.double().clone() for p in self._step_state(k, states[k], B)])
                x = xo
            outs.append(self.module.post_blocks_norm(x))
        seq = {n: [torch.cat(v, dim=1) for v in per] for n, per in rec.items()}  # (B, T, ·)
        stacked = [[torch.stack([p[j] for p in parts[k]], dim=1) for j in range(len(parts[k][0]))]
                   for k in range(L)]
        aux = [stacked[k].pop() for k in range(L)]  # each family puts m last
        return {**seq, "parts": stacked, "aux": aux, "output": torch.cat(outs, dim=1)}

    def _conv(self, layer: nn.Module, buf: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """silu(causal conv) of v with the buffer of its last inputs: (x̂, the new buffer)."""
        K, D = self.conv_width, v.shape[-1]
        if K == 0:
            return v, buf
        window = torch.cat([buf.view(-1, K - 1, D), v[:, None]], dim=1)  # (R, K, D)
        conv = layer.conv1d.conv
        out = (window * conv.weight[:, 0].T).sum(dim=1)
        if conv.bias is not None:
            out = out + conv.bias
        return F.silu(out), window[:, 1:].reshape(-1, (K - 1) * D)

    def _buffer(self, st: dict, B: int) -> list[Tensor]:
        if self.conv_width == 0:
            return [st["conv_state"][0].new_zeros(B, 0)] if st.get("conv_state") else []
        conv = st["conv_state"][0]  # (B, K, D): the last K inputs, oldest first
        return [conv[:, 1:].reshape(B, -1)]

    def pre(self, k, m, x):
        return m.blocks[k].xlstm_norm(x)

    def post(self, k, m, x, y):
        block = m.blocks[k]
        x = x + y
        return x if block.ffn is None else x + block.ffn(block.ffn_norm(x))

    def final(self, m, x):
        return m.post_blocks_norm(x)


class XLSTMSLSTMFamily(XLSTMStack):
    """xlstm's xLSTMBlockStack of sLSTM blocks (vanilla backend)."""

    name = "xlstm-slstm"
    opens_what = "xlstm's xLSTMBlockStack / xLSTMLMModel of sLSTM blocks (NX-AI, 2.0.6)"
    cell_name = "xlstm_slstm"
    kind = "sLSTMLayer"
    specs = (XLSTM_SLSTM,)
    recipe = SLSTM_RECIPE

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        cells = [type(layer.slstm_cell).__name__ for layer in self.layers]
        if "sLSTMCell_cuda" in cells and not next(module.parameters()).is_cuda:
            raise GatelensError("xlstm: CUDA-backend sLSTM cells on the CPU; convert them "
                                "first with gatelens.families.xlstm_slstm.to_vanilla(stack)")
        if any(layer.slstm_cell.config.function != "slstm" for layer in self.layers):
            raise GatelensError("xlstm: only the sLSTM pointwise function is supported")

    @property
    def hidden_size(self) -> int:
        return int(self.layers[0].config.hidden_size)

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.hidden_size)

    def part_units(self, k: int) -> list[Tensor]:
        H, u = self.hidden_size, self.state_units(k)
        buf = [buffer_units(self.conv_width, H)] if self.conv_width else []
        return buf + [u, u, u]  # h, s, ℓ

    def _step_state(self, k, st, B):
        h, c, n, m = st["slstm_state"]  # (B, H) each
        return self._buffer(st, B) + [h, c / n, m + torch.log(n), m]

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        H = self.hidden_size
        buf = zeros64(self.module, batch, (self.conv_width - 1) * H) if self.conv_width else []
        return buf + zeros64(self.module, batch, H, H) + [self.initial_stabiliser(k, batch)]

    def initial_stabiliser(self, k: int, batch: int) -> Tensor:
        """The stabiliser before the first step: −∞, so m' = ĩ (the package's "n = 0")."""
        return zeros64(self.module, batch, self.hidden_size, fill=-torch.inf)[0]

    def step_cell(self, k, m, u, parts, aux, edit=no_edit, prev=None):
        """One step; ``prev`` (an edited run): the stabiliser m before the step, from which
        m' is computed as the package does (returned as ``sig["m"]``), else ``aux`` is m'."""
        layer = m.blocks[k].xlstm
        cell = layer.slstm_cell
        *buf, h, s, ell = parts
        xc, buf = self._conv(layer, buf[0] if buf else None, u)
        wx = torch.cat([layer.fgate(xc), layer.igate(xc), layer.zgate(u), layer.ogate(u)], -1)
        NH, H = cell.config.num_heads, self.hidden_size
        R = cell._recurrent_kernel_int2ext(cell._recurrent_kernel_)  # (NH, d_in, 4, d_out)
        b = cell._bias_int2ext(cell._bias_).permute(1, 0, 2).reshape(-1)  # (4H), gate-major
        ry = torch.einsum("rnd,ndge->rgne", h.view(-1, NH, H // NH), R).reshape(-1, 4 * H)
        pi, pf, pz, po = (wx + ry + b).chunk(4, dim=-1)  # (R, H) each, its order i, f, z, o
        z, o = edit("z", torch.tanh(pz)), edit("o", torch.sigmoid(po))
        f0 = torch.sigmoid(pf)
        f = edit("f", f0)
        log_f = F.logsigmoid(pf) if f is f0 else torch.log(f)
        m_new = aux if prev is None else torch.maximum(pi, log_f + prev)
        # i is the package's stabilised exp(ĩ − m'); an edited i is written as i · e^{m'}
        ref = torch.logaddexp(log_f + ell, pi) if m_new is None else m_new
        i0 = torch.exp(pi - ref)
        i = edit("i", i0)
        ell_new = torch.logaddexp(log_f + ell, pi if i is i0 else torch.log(i) + ref)
        kappa0 = torch.exp(log_f + ell - ell_new)
        kappa = edit("kappa", kappa0)
        if kappa is not kappa0:  # an edited keep: n' = f n / κ
            ell_new = log_f + ell - torch.log(kappa)
        s_new = edit("s", kappa * s + (1 - kappa) * z)
        h_new = edit("h", o * s_new)
        y = layer.group_norm(h_new.view(-1, NH, 1, H // NH)).transpose(1, 2).reshape(-1, H)
        sig = {"z": z, "i": i, "f": f, "o": o, "kappa": kappa, "h": h_new, "m": m_new}
        return sig, ([buf] if self.conv_width else []) + [h_new, s_new, ell_new], y

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[-2]  # s = c/n
