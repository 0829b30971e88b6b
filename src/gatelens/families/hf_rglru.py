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
The units are the channels (lru_width); the input enters s through the convolution's
window of conv1d_width positions. The states come from one whole-sequence forward: its
RG-LRU scans token by token in float32, replayed on the input it received (``rglru_replay``;
``step_vs_forward``: the replay against the RG-LRU's output, 0 in float32). A block on
another forward is read on its decode path (its own cache, one token at a time, the RG-LRU
state in float32 whatever the model's dtype), the tests' independent per-token reference.

``--cell hf-rglru`` trains an ``RGLRUStack``: the package's own recurrent residual blocks
(no local attention) and its final norm; the family opens it as one stack, its blocks and
final norm checked link by link, as the Mamba and Gated DeltaNet stacks are.

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
from gatelens.families.buffers import zeros64
from gatelens.families.delta_edit import StepEdits, no_edit
from gatelens.families.delta_scan import torch_path
from gatelens.families.forward_scan import linear_scan
from gatelens.families.official import OfficialFamily
from gatelens.families.recipe import Recipe
from gatelens.families.records import Recorder, buffer_units, conv_buffer, scaled_diff, worst_of
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


class RGLRUStack(nn.Module):
    """What ``--cell hf-rglru`` trains: ``layers`` of RecurrentGemma's own recurrent residual
    blocks (RG-LRU temporal block, then its MLP; all recurrent, no local attention), then
    its final RMSNorm, taken from a ``RecurrentGemmaModel`` so that the package's own
    initialisation sets them (its recurrent parameters are uninitialised otherwise); the
    embedding is the language model's. (B, T, d) in, (B, T, d) out, from position 0."""

    def __init__(self, hidden: int, layers: int, settings: dict) -> None:
        super().__init__()
        import transformers

        cfg = transformers.RecurrentGemmaConfig(
            vocab_size=2, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=hidden // settings["head_width"],
            intermediate_size=settings["mlp_ratio"] * hidden,
            conv1d_width=settings["conv_width"], block_types=("recurrent",),
            use_cache=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = transformers.RecurrentGemmaModel(cfg)
        self.layers = model.layers
        self.final_norm = model.final_norm

    def forward(self, x: Tensor) -> Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None]
        for layer in self.layers:
            x = layer(x, pos, None, False)
        return self.final_norm(x)


#: ``--cell hf-rglru``: block-diagonal gates of 16 channels a head, conv 4, the MLP's
#: intermediate 3 × hidden (the package halves it: gate and up of 1.5 × hidden)
_SETTINGS = {"head_width": 16, "conv_width": 4, "mlp_ratio": 3}


def _build(n_in: int, hidden: int, layers: int, *, settings: dict, **_: object) -> nn.Module:
    return RGLRUStack(hidden, layers, settings)


RGLRU_RECIPE = Recipe(
    "hf-rglru", "RecurrentGemma's recurrent residual blocks (RG-LRU and MLP; transformers)",
    _build, reads="embedded", flags=frozenset(), package=("transformers", "transformers"),
    settings=_SETTINGS, multiple=lambda heads: _SETTINGS["head_width"],
    keep_words="RG-LRU σ(Λ)^(8r)")


def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """RecurrentGemma's RMSNorm, x / rms(x) · (1 + w), in x's dtype (the package rounds
    to float32 inside; the hand cell stays in float64)."""
    w = norm.weight.to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + w)


class HFRGLRUFamily(StepEdits, OfficialFamily):
    """One recurrent residual block of transformers' RecurrentGemma (a
    ``RecurrentGemmaDecoderLayer`` whose ``temporal_block`` is the RG-LRU block)."""

    name = "hf-rglru"
    opens_what = ("transformers' RecurrentGemma recurrent blocks (RG-LRU, Griffin; each "
                  "RecurrentGemmaDecoderLayer with a recurrent temporal block)")
    cell_name = "rglru"
    specs = (RGLRU,)
    recipe = RGLRU_RECIPE
    units_name = "channel"
    uses_aux = True  # the reset at position 0, from the trajectory
    live_aux = "reset"  # which an edited run gives itself (families/official_edit.py)

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        if type(module) is RGLRUStack:
            return True
        if type(module).__module__ != _HF or type(module).__name__ != \
                "RecurrentGemmaDecoderLayer":
            return False
        block = getattr(module, "temporal_block", None)
        return type(block).__name__ == "RecurrentGemmaRecurrentBlock"

    @property  # ---- facts -------------------------------------------------------
    def _stack(self) -> bool:
        return isinstance(self.module, RGLRUStack)

    def layers(self, m: nn.Module) -> list[nn.Module]:
        """The recurrent residual blocks of ``m`` (the module or its float64 copy)."""
        return list(m.layers) if isinstance(m, RGLRUStack) else [m]

    @property
    def _block(self) -> nn.Module:  # every block has the same shape
        return self.layers(self.module)[0].temporal_block

    @property
    def num_layers(self) -> int:
        return len(self.layers(self.module))

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
        where = {"layers": self.num_layers} if self._stack else {
            "block": "recurrent (RG-LRU); attention blocks are not opened"}
        return {**super().describe(), "heads": int(lru.num_attention_heads),
                "conv_width": self.d_conv, **where}

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.width)

    def part_units(self, k: int) -> list[Tensor]:
        return [buffer_units(self.d_conv, self.width), self.state_units(k)]

    def input_window(self) -> int:
        return self.d_conv

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        return zeros64(self.module, batch, (self.d_conv - 1) * self.width, self.width)

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict):
        """(activations, None), or the position ids where they are not 0 … T − 1."""
        if self._stack:
            return OfficialFamily.split_call(self, args, kwargs)
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
        if self._stack:
            return self.module(call.inputs)
        block = self._block
        pos = torch.arange(call.length, device=call.inputs.device)[None]
        saved = (block.conv1d_state, block.rg_lru.recurrent_states)
        try:  # use_cache=False sets the block's cache to None: put it back
            return self.module(call.inputs, pos, None, False)
        finally:
            block.conv1d_state, block.rg_lru.recurrent_states = saved

    def _trajectory(self, call: Call) -> dict:
        layers, B, T = self.layers(self.module), call.batch, call.length
        W, K, x = self.width, self.d_conv, call.inputs
        blocks = [layer.temporal_block for layer in layers]
        saved = [(b.conv1d_state, b.rg_lru.recurrent_states) for b in blocks]
        for b in blocks:  # the package's own cache, zeros of its shapes (its own set-up
            # sizes the conv's buffer by hidden_size, which is lru_width in every release)
            b.conv1d_state = x.new_zeros(B, W, K - 1)
            b.rg_lru.recurrent_states = torch.zeros(B, W, dtype=torch.float32, device=x.device)
        L = len(layers)
        ins, outs = [[] for _ in range(L)], [[] for _ in range(L)]
        states, convs = [[] for _ in range(L)], [[] for _ in range(L)]
        try:
            with Recorder({str(k): b for k, b in enumerate(blocks)}) as rec:
                for t in range(T):
                    pos = torch.full((B, 1), t, dtype=torch.long, device=x.device)
                    h = x[:, t : t + 1]
                    for k, (layer, b) in enumerate(zip(layers, blocks, strict=True)):
                        ins[k].append(h)
                        h = layer(h, pos, None, True)
                        outs[k].append(h)
                        states[k].append(b.rg_lru.recurrent_states[:, None].clone())
                        convs[k].append(b.conv1d_state.transpose(1, 2).reshape(B, 1, -1).clone())
        finally:
            for b, (conv, state) in zip(blocks, saved, strict=True):
                b.conv1d_state, b.rg_lru.recurrent_states = conv, state
        xo = [torch.cat(o, dim=1) for o in outs]
        output = self.module.final_norm(xo[-1]) if self._stack else xo[-1]
        reset = torch.zeros(B, T, 1, dtype=x.dtype, device=x.device)
        reset[:, 0] = 1.0
        return {"x": [torch.cat(i, dim=1) for i in ins],
                "u": [rec.stacked(str(k)) for k in range(L)],
                "y": [rec.stacked(str(k), outputs=True) for k in range(L)], "xo": xo,
                "parts": [[torch.cat(convs[k], 1), torch.cat(states[k], 1)] for k in range(L)],
                "aux": [reset] * L, "output": output}

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each block, its linear_x, RG-LRU and temporal block; None on another forward."""
        layers = self.layers(self.module)
        if not all(torch_path(m, ()) for lay in layers for m in (lay.temporal_block,
                                                               lay.temporal_block.rg_lru)):
            return None
        return {f"{n}{k}": mod for k, lay in enumerate(layers) for n, mod in (
            ("layer", lay), ("block", lay.temporal_block),
            ("lx", lay.temporal_block.linear_x), ("lru", lay.temporal_block.rg_lru))}

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        """Each RG-LRU's scan replayed on its input (``rglru_replay``) against its output."""
        L, (B, T) = self.num_layers, rec.stacked("lru0").shape[:2]
        reset = torch.arange(T, device=output.device)[None, :, None] == 0  # position 0
        parts, own, gap = [], [], (0.0, 0.0)
        for k, layer in enumerate(self.layers(self.module)):
            sig, s = rglru_replay(layer.temporal_block.rg_lru, rec.stacked(f"lru{k}"), reset)
            d = scaled_diff(s, rec.stacked(f"lru{k}", outputs=True))
            gap = worst_of([gap, d])
            parts.append([conv_buffer(rec.stacked(f"lx{k}", outputs=True), self.d_conv), s])
            own.append({n: v.to(output.dtype) for n, v in sig.items()})
        aux = reset.expand(B, T, 1).to(output.dtype)
        got = {n: [rec.stacked(f"{m}{k}", outputs=o) for k in range(L)]
               for n, m, o in (("x", "layer", False), ("u", "block", False),
                               ("y", "block", True), ("xo", "layer", True))}
        return {**got, "parts": parts, "aux": [aux] * L, "output": output, "own": own,
                "step_vs_forward": gap}

    # ---- the hand cell ------------------------------------------------------------
    def step_cell(self, k, m, u, parts, aux, edit=no_edit):
        block = self.layers(m)[k].temporal_block
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
        i = edit("i", torch.sigmoid(torch.einsum("rhj,hjk->rhk", xh, lru.input_gate_weight)
                                    + lru.input_gate_bias).reshape(-1, W))
        r = edit("r", torch.sigmoid(torch.einsum(
            "rhj,hjk->rhk", xh, lru.recurrent_gate_weight) + lru.recurrent_gate_bias
        ).reshape(-1, W))
        log_a = -C_LRU * r * F.softplus(lru.recurrent_param)
        a0 = torch.exp(log_a)
        a = edit("a", a0)  # an edited keep: its normalisation √(1 − a²) follows it
        norm = torch.sqrt(1 - torch.exp(2 * log_a)) if a is a0 else torch.sqrt(
            (1 - a * a).clamp_min(0))
        keep = a
        if aux is not None:  # the package's reset at position 0: no keep, no normalisation
            keep = a * (1 - aux)
            norm = aux + (1 - aux) * norm
        write = edit("write", norm * i)
        xc = edit("x", xc)  # the written x̂ (the gates read the unedited one)
        s_new = edit("s", keep * s + write * xc)
        y = block.linear_out(s_new * gate_y)
        new = [window[:, 1:].reshape(-1, (K - 1) * W), s_new]
        return {"r": r, "i": i, "a": a, "write": write, "x": xc}, new, y

    def scan_layer(self, k: int, m: nn.Module, u: Tensor
                   ) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
        """Layer k's hand cell over a window ``u`` (B, T, F) from position 0: ``step_cell`` on
        every position at once from a zero state (its gates read no state; s is linear, so
        that step's s is the input term write ⊙ x̂), then s_t = keep_t ⊙ s_{t−1} + write_t ⊙ x̂_t
        along time, keep_0 = 0 (the reset). (signals, parts, y), each (B, T, ·)."""
        block, (B, T), W = self.layers(m)[k].temporal_block, u.shape[:2], self.width
        xb = block.linear_x(u)  # (B, T, W): the convolution's input
        buf = conv_buffer(torch.cat([xb.new_zeros(B, 1, W), xb[:, :-1]], dim=1), self.d_conv)
        reset = (torch.arange(T, device=u.device) == 0).to(u.dtype)[None, :, None]  # (1, T, 1)
        parts = [buf.reshape(B * T, -1), u.new_zeros(B * T, W)]
        sig, (_, b), _ = self.step_cell(k, m, u.reshape(B * T, -1), parts,
                                        reset.expand(B, T, 1).reshape(B * T, 1))
        sig = {n: v.view(B, T, W) for n, v in sig.items()}
        keep = (sig["a"] * (1 - reset)).transpose(0, 1)  # (T, B, W)
        s = linear_scan(keep, b.view(B, T, W).transpose(0, 1)).transpose(0, 1)
        y = block.linear_out(s * block.act_fn(block.linear_y(u)))
        return sig, [conv_buffer(xb, self.d_conv), s], y

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[1]

    def pre(self, k, m, x):
        return rms_norm(self.layers(m)[k].temporal_pre_norm, x)

    def post(self, k, m, x, y):
        layer = self.layers(m)[k]
        res = x + y
        return res + layer.mlp_block(rms_norm(layer.channel_pre_norm, res))

    def final(self, m, x):
        return rms_norm(m.final_norm, x) if isinstance(m, RGLRUStack) else x

    # ---- the dynamics: from after position 0 (the reset), where no step resets ---------
    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        plain = Reference(states=ref.states, inputs=ref.inputs, initial=ref.initial,
                          output=ref.output, final=ref.final,
                          extra={**ref.extra, "aux": [None] * self.num_layers})
        (dyn,) = super().dynamics(call, plain)
        return [replace(dyn, initial=[p[:, 0].double() for p in dyn.trajectory],
                        order=list(range(1, call.length)), offset=1)]


@torch.no_grad()
def rglru_replay(lru: nn.Module, x: Tensor, reset: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """``RecurrentGemmaRglru.forward`` on the input x̂ (B, T, W) it received, in its own
    operations and layout, its float32 ``_rnn_scan`` replayed by forward_scan.linear_scan
    (its multiply, then its add): the trace's r, i, a (the gate's value, at the reset too),
    write = √(1 − a²)·i (1·i at the reset), x = x̂ and s (float32), each (B, T, W)."""
    B, T, W = x.shape
    heads = int(lru.num_attention_heads)
    act = x.reshape(B * T, heads, W // heads).permute(1, 0, 2)  # (heads, B·T, block)

    def gate(weight: Tensor, bias: Tensor) -> Tensor:
        res = torch.baddbmm(bias[:, None, :], act, weight)
        return torch.sigmoid(res.transpose(0, 1).reshape(B, T, W))

    i = gate(lru.input_gate_weight, lru.input_gate_bias)
    r = gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    log_a = -C_LRU * r * F.softplus(lru.recurrent_param)
    a = torch.exp(log_a)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))  # SqrtBoundDerivative's forward
    multiplier = reset + ~reset * multiplier
    b = (x * i) * multiplier.type(x.dtype)  # (B, T, W): the normalised input
    s = linear_scan((a * ~reset).float().transpose(0, 1), b.float().transpose(0, 1))
    return {"r": r, "i": i, "a": a, "write": multiplier * i, "x": x}, s.transpose(0, 1)
