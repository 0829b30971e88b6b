"""transformers' RecurrentGemma (Griffin): its recurrent residual blocks, each opened on
its own (``RecurrentGemmaDecoderLayer`` whose temporal block is the RG-LRU block, inside
``RecurrentGemmaForCausalLM``; 5.23). Its local-attention blocks are left alone.

One block (METHODS "The 2026 families", RG-LRU), with u = RMSNorm(x) (Gemma's 1 + w):
  x̂ = conv1d(linear_x(u))  (causal, depthwise, conv1d_width taps);
  i_t = σ(W_i x̂ + b_i),  r_t = σ(W_r x̂ + b_r)  (block-diagonal, one block a head);
  a_t = σ(Λ)^(c·r_t) per channel, c = 8: ln a_t = −c r_t softplus(−Λ), the package
        holding −Λ as ``recurrent_param`` (ln a_t = −8 r_t softplus(recurrent_param));
  s_t = a_t ⊙ s_{t−1} + √(1 − a_t²) ⊙ (i_t ⊙ x̂_t);
  y = linear_out(s_t ⊙ gelu(linear_y(u))); the block: r = x + y, out = r + MLP(RMSNorm r).
At position 0 the package resets (its ``position_ids == 0``): s_0 = i_0 ⊙ x̂_0, neither a_0
nor √(1 − a_0²) applied. The trace's a_0 is the gate's value there (what the keep would be);
the step takes the reset from the trajectory (``aux``), and the dynamics start after it.
The units are the channels (lru_width). The module's own trajectory: the block run one
token at a time with its own cache (its decode branch: the conv's last inputs and the
RG-LRU's state, which the package keeps in float32 whatever the model's dtype), against
its whole-sequence forward (``step_vs_forward``). The input enters s through the
convolution's window of conv1d_width positions.

>>> import torch
>>> from transformers import RecurrentGemmaConfig, RecurrentGemmaModel
>>> cfg = RecurrentGemmaConfig(vocab_size=7, hidden_size=8, intermediate_size=16,
...     num_attention_heads=2, num_hidden_layers=2, block_types=("recurrent", "attention"),
...     attention_window_size=4, use_cache=False)
>>> m = RecurrentGemmaModel(cfg)
>>> [HFRGLRUFamily.opens(layer) for layer in m.layers]
[True, False]
>>> fam = HFRGLRUFamily(m.layers[0])
>>> call = fam.check(torch.randn(2, 6, 8))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call, Dynamics, Reference
from gatelens.families.official import OfficialFamily, Recorder, buffer_units
from gatelens.families.spec import SIGMOID, CellSpec

_HF = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
#: the package's c in a = σ(Λ)^(c·r) (a literal −8.0 in its RG-LRU)
C_LRU = 8.0

#: RG-LRU's cell: s is the recurrence's state per channel, y the block's (the temporal
#: block's) output; the keep a scales s, the write √(1 − a²)·i scales the written x̂
RGLRU = CellSpec(
    name="rglru", kind="rglru", chunks=("i", "r"),
    signals=("r", "i", "a", "write", "x", "s", "y"), gates=("r", "i", "a"), keep_gate="a",
    input_gate=None, state="s", output="y",
    bounds={"r": SIGMOID, "i": SIGMOID, "a": SIGMOID, "write": SIGMOID},
    display={"a": "keep σ(Λ)^(8r) per channel", "r": "recurrence gate r",
             "i": "input gate i", "write": "write √(1 − a²)·i", "x": "written x̂ (conv)"})


def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """RecurrentGemma's RMSNorm, x / rms(x) · (1 + w), in x's dtype (the package rounds
    to float32 inside; the hand cell stays in float64)."""
    w = norm.weight.to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + w)


class HFRGLRUFamily(OfficialFamily):
    """One recurrent residual block of transformers' RecurrentGemma (a
    ``RecurrentGemmaDecoderLayer`` whose ``temporal_block`` is the RG-LRU block)."""

    name = "hf-rglru"
    opens_what = ("transformers' RecurrentGemma recurrent blocks (RG-LRU, Griffin; each "
                  "RecurrentGemmaDecoderLayer with a recurrent temporal block)")
    cell_name = "rglru"
    specs = (RGLRU,)
    units_name = "channel"
    uses_aux = True  # the reset at position 0, from the trajectory

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        if type(module).__module__ != _HF or type(module).__name__ != \
                "RecurrentGemmaDecoderLayer":
            return False
        block = getattr(module, "temporal_block", None)
        return type(block).__name__ == "RecurrentGemmaRecurrentBlock"

    # ---- facts ---------------------------------------------------------------------
    @property
    def _block(self) -> nn.Module:
        return self.module.temporal_block

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def width(self) -> int:
        return int(self._block.lru_width)

    @property
    def d_conv(self) -> int:
        return int(self._block.conv1d_width)

    @property
    def hidden_size(self) -> int:
        return self.width

    def describe(self) -> dict:
        lru = self._block.rg_lru
        return {**super().describe(), "heads": int(lru.num_attention_heads),
                "conv_width": self.d_conv,
                "block": "recurrent (RG-LRU); attention blocks are not opened"}

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.width)

    def part_units(self, k: int) -> list[Tensor]:
        return [buffer_units(self.d_conv, self.width), self.state_units(k)]

    def input_window(self) -> int:
        return self.d_conv

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        return [torch.zeros(batch, (self.d_conv - 1) * self.width, dtype=torch.float64),
                torch.zeros(batch, self.width, dtype=torch.float64)]

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict):
        """(activations, None), or the position ids where they are not 0 … T − 1."""
        inputs = args[0] if args else kwargs.get("activations")
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        cache = args[4] if len(args) > 4 else kwargs.get("past_key_values")
        if cache is not None:
            return inputs, cache
        if pos is not None and isinstance(inputs, Tensor) and inputs.ndim == 3:
            want = torch.arange(inputs.shape[1], device=pos.device)
            if pos.shape[-1] != inputs.shape[1] or bool((pos != want).any()):
                return inputs, pos
        return inputs, None

    def check(self, inputs, state=None) -> Call:
        if state is not None:
            raise GatelensError(
                f"{self.name}: a call with a cache or with positions other than 0 … T − 1 "
                f"(got {type(state).__name__}) is not supported; the analysis runs from "
                "position 0 and zero state")
        return OfficialFamily.check(self, inputs)

    # ---- the module's own computation ------------------------------------------------
    def _forward(self, call: Call) -> Tensor:
        block = self._block
        pos = torch.arange(call.length, device=call.inputs.device)[None]
        saved = (block.conv1d_state, block.rg_lru.recurrent_states)
        try:  # use_cache=False sets the block's cache to None: put it back
            return self.module(call.inputs, pos, None, False)
        finally:
            block.conv1d_state, block.rg_lru.recurrent_states = saved

    def _trajectory(self, call: Call) -> dict:
        block, B, T = self._block, call.batch, call.length
        W, K, x = self.width, self.d_conv, call.inputs
        saved = (block.conv1d_state, block.rg_lru.recurrent_states)
        # the package's own cache, zeros of its shapes (its own set-up sizes the conv's
        # buffer by hidden_size, which is lru_width in every released model)
        block.conv1d_state = x.new_zeros(B, W, K - 1)
        block.rg_lru.recurrent_states = torch.zeros(B, W, dtype=torch.float32, device=x.device)
        states, convs, outs = [], [], []
        try:
            with Recorder({"block": block}) as rec:
                for t in range(T):
                    pos = torch.full((B, 1), t, dtype=torch.long, device=x.device)
                    outs.append(self.module(x[:, t : t + 1], pos, None, True))
                    states.append(block.rg_lru.recurrent_states[:, None].clone())
                    convs.append(block.conv1d_state.transpose(1, 2).reshape(B, 1, -1).clone())
        finally:
            block.conv1d_state, block.rg_lru.recurrent_states = saved
        output = torch.cat(outs, dim=1)
        reset = torch.zeros(B, T, 1, dtype=x.dtype, device=x.device)
        reset[:, 0] = 1.0
        return {"x": [x], "u": [rec.stacked("block")], "y": [rec.stacked("block", outputs=True)],
                "xo": [output], "parts": [[torch.cat(convs, 1), torch.cat(states, 1)]],
                "aux": [reset], "output": output}

    # ---- the hand cell ------------------------------------------------------------
    def step_cell(self, k, m, u, parts, aux):
        block = m.temporal_block
        lru = block.rg_lru
        W, K, NH = self.width, self.d_conv, int(lru.num_attention_heads)
        buf, s = parts
        gate_y = block.act_fn(block.linear_y(u))  # (R, W)
        xb = block.linear_x(u)
        window = torch.cat([buf.view(-1, K - 1, W), xb[:, None]], dim=1)  # (R, K, W)
        xc = (window * block.conv_1d.weight[:, 0].T).sum(dim=1)  # tap j on x_{t−K+1+j}
        if block.conv_1d.bias is not None:
            xc = xc + block.conv_1d.bias
        xh = xc.view(-1, NH, W // NH)  # (R, heads, block width)
        i = torch.sigmoid(torch.einsum("rhj,hjk->rhk", xh, lru.input_gate_weight)
                          + lru.input_gate_bias).reshape(-1, W)
        r = torch.sigmoid(torch.einsum("rhj,hjk->rhk", xh, lru.recurrent_gate_weight)
                          + lru.recurrent_gate_bias).reshape(-1, W)
        log_a = -C_LRU * r * F.softplus(lru.recurrent_param)
        a = torch.exp(log_a)
        norm = torch.sqrt(1 - torch.exp(2 * log_a))
        keep = a
        if aux is not None:  # the package's reset at position 0: no keep, no normalisation
            keep = a * (1 - aux)
            norm = aux + (1 - aux) * norm
        write = norm * i
        s_new = keep * s + write * xc
        y = block.linear_out(s_new * gate_y)
        new = [window[:, 1:].reshape(-1, (K - 1) * W), s_new]
        return {"r": r, "i": i, "a": a, "write": write, "x": xc}, new, y

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[1]

    def pre(self, k, m, x):
        return rms_norm(m.temporal_pre_norm, x)

    def post(self, k, m, x, y):
        res = x + y
        return res + m.mlp_block(rms_norm(m.channel_pre_norm, res))

    # ---- the dynamics: from after position 0 (the reset), where no step resets ---------
    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        plain = Reference(states=ref.states, inputs=ref.inputs, initial=ref.initial,
                          output=ref.output, final=ref.final,
                          extra={**ref.extra, "aux": [None]})
        (dyn,) = super().dynamics(call, plain)
        return [replace(dyn, initial=[p[:, 0] for p in dyn.trajectory],
                        order=list(range(1, call.length)), offset=1)]
