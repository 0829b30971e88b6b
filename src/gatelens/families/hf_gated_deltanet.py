"""transformers' Gated DeltaNet layer (5.23): ``Qwen3NextGatedDeltaNet`` (Qwen3-Next), the
same layer in Qwen3.5 / Qwen3.5-MoE (``Qwen3_5GatedDeltaNet``, ``Qwen3_5MoeGatedDeltaNet``)
and OLMo Hybrid (``OlmoHybridGatedDeltaNet``), each opened where it sits inside the whole
model (``model.layers.K.linear_attn``); the attention layers between them are left alone.

The layer, per value head h (H_v heads; each key head serves H_v / H_k of them), as the
package computes it:
  q, k, v ← act(causal depthwise conv(W_qkv u))  (d_conv taps, no bias; act = silu);
  z = W_z u,  β = σ(W_b u) (× 2 where OLMo Hybrid allows negative eigenvalues),
  α = exp(g),  g = −exp(A_log) · softplus(W_a u + dt_bias)  (one per head);
  k ← k / ‖k‖,  q ← q / ‖q‖ / √d_k  (l2norm with ε = 1e-6 inside the norm);
  S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,  S ∈ R^(d_v × d_k);
  o_t = S_t q_t;  y = out_proj(RMSNorm(o_t) · w ⊙ silu(z_t))  (per head, over d_v).
The trace holds S as METHODS writes it, (d_v × d_k) per head, flattened head by head (the
package's cache holds Sᵀ, (d_k × d_v)); k is the normalised key of each value head. The
keep operator is A_t(S) = α_t S (I − β_t k_t k_tᵀ) (``delta_keep``: the perturbation split's
forget path applies it, a matrix product, not an element-wise one); the keep gate is α per
head, the write strength β, the written vector v.

The per-token states come from ONE whole-sequence forward (families/delta_scan.py): the
layer's chunked prompt path (``torch_chunk_gated_delta_rule``, given a fresh cache so that
it leaves its final state) with hooks on its projections, and the package's recurrent step
replayed on what they returned, bit for bit ``torch_recurrent_gated_delta_rule`` over the
window; the chunked output against it is ``step_vs_forward``, the chunked final state
``final_vs_step``. Where the layer runs a fused kernel instead, the decode path is read: the
layer stepped one token at a time with transformers' own cache (``causal_conv1d_update``
and the recurrent step), from a zero conv window and state. Both compute the delta rule in
float32 whatever the model's dtype.

``--cell hf-gated-deltanet`` trains a ``GatedDeltaNetStack``: Qwen3-Next's own layer in
pre-norm residual blocks with no attention between them; the family opens it as one stack
(its layers, norms and residuals checked link by link, as the Mamba stacks are).

>>> import torch
>>> from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
>>> cfg = Qwen3NextConfig(vocab_size=7, hidden_size=16, intermediate_size=16,
...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
...     linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
...     linear_value_head_dim=4, linear_conv_kernel_dim=3, num_experts=0,
...     layer_types=["linear_attention", "full_attention"])
>>> model = Qwen3NextForCausalLM(cfg)
>>> fam = HFGatedDeltaNetFamily(model.model.layers[0].linear_attn)
>>> call = fam.check(torch.randn(2, 6, 16))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call, Reference
from gatelens.families.buffers import zeros64
from gatelens.families.delta_cell import DeltaCell
from gatelens.families.delta_edit import StepEdits
from gatelens.families.delta_scan import DeltaForward
from gatelens.families.official import OfficialFamily, buffer_units, scaled_diff
from gatelens.families.recipe import Recipe
from gatelens.families.records import worst_of
from gatelens.families.spec import SIGMOID, CellSpec

#: the classes opened, by module path (transformers stays unimported until one is opened)
CLASSES = {
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet"),
}


def delta_keep(signals: dict[str, Tensor], s: Tensor) -> Tensor:
    """The keep operator of one step on a carried state: A_t(S) = α_t S (I − β_t k_t k_tᵀ)
    per head. ``signals``: that step's ``alpha`` (N, H), ``beta`` (N, H), ``k`` (N, H·d_k);
    ``s`` (N, H·d_v·d_k), each head's S (d_v × d_k) row by row.

    >>> sig = {"alpha": torch.tensor([[0.5]]), "beta": torch.tensor([[1.0]]),
    ...        "k": torch.tensor([[1.0, 0.0]])}
    >>> delta_keep(sig, torch.tensor([[1.0, 2.0]])).tolist()  # k's direction is erased
    [[0.0, 1.0]]
    """
    alpha, beta, k = signals["alpha"], signals["beta"], signals["k"]
    N, H = alpha.shape
    dk = k.shape[-1] // H
    S = s.reshape(N, H, -1, dk)  # (N, H, d_v, d_k)
    kk = k.reshape(N, H, 1, dk)
    Sk = (S * kk).sum(dim=-1, keepdim=True)  # (N, H, d_v, 1): S k
    return (alpha[..., None, None] * (S - beta[..., None, None] * Sk * kk)).reshape(N, -1)


def _cell(name: str, beta: tuple[float, float]) -> CellSpec:
    return CellSpec(
        name=name, kind="gated-deltanet", chunks=("q", "k", "v"),
        signals=("alpha", "beta", "k", "v", "s", "y"), gates=("alpha", "beta"),
        keep_gate="alpha", input_gate=None, state="s", output="y",
        bounds={"alpha": SIGMOID, "beta": beta}, keep_operator=delta_keep,
        display={"alpha": "decay α = exp(g) per head", "beta": "write strength β per head"})


#: β = σ(·) ∈ (0, 1) (Qwen3-Next, Qwen3.5; OLMo Hybrid without negative eigenvalues)
GATED_DELTANET = _cell("gated_deltanet", SIGMOID)
#: β = 2σ(·) ∈ (0, 2): OLMo Hybrid's ``linear_allow_neg_eigval`` (I − βkkᵀ may flip k)
GATED_DELTANET_NEG = _cell("gated_deltanet_neg", (0.0, 2.0))


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """The package's ``l2norm``: x / √(Σ x² + ε) over the last axis."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNetStack(nn.Module):
    """What ``--cell hf-gated-deltanet`` trains: ``layers`` of Qwen3-Next's own Gated DeltaNet
    layer, each in a pre-norm residual block x ← x + GDN(RMSNorm x) (PyTorch's RMSNorm),
    then a final RMSNorm; no attention and no MLP between them, so the stack is a
    recurrence alone, as a Mamba stack is. (B, T, d) in, (B, T, d) out."""

    def __init__(self, hidden: int, layers: int, settings: dict) -> None:
        super().__init__()
        import transformers

        cfg = transformers.Qwen3NextConfig(
            vocab_size=2, hidden_size=hidden, num_hidden_layers=layers, num_experts=0,
            layer_types=["linear_attention"] * layers,
            linear_num_key_heads=hidden // settings["key_head_dim"],
            linear_num_value_heads=hidden // settings["value_head_dim"],
            linear_key_head_dim=settings["key_head_dim"],
            linear_value_head_dim=settings["value_head_dim"],
            linear_conv_kernel_dim=settings["conv_kernel"])
        gdn = transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet
        self.layers = nn.ModuleList(gdn(cfg, k) for k in range(layers))
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, eps=1e-6) for _ in range(layers))
        self.norm_f = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, x: Tensor) -> Tensor:
        for norm, layer in zip(self.norms, self.layers, strict=True):
            x = x + layer(norm(x))
        return self.norm_f(x)


_SETTINGS = {"key_head_dim": 16, "value_head_dim": 16, "conv_kernel": 4}


def _build(n_in: int, hidden: int, layers: int, *, settings: dict, **_: object) -> nn.Module:
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on the missing fla / causal_conv1d kernels
    return GatedDeltaNetStack(hidden, layers, settings)


#: ``--cell hf-gated-deltanet``: heads of 16 (keys and values), conv 4; --hidden a multiple
#: of 16 (the heads fill it)
GDN_RECIPE = Recipe(
    "hf-gated-deltanet", "Qwen3-Next's Gated DeltaNet layers (transformers) in pre-norm "
    "residual blocks", _build, reads="embedded", flags=frozenset(),
    package=("transformers", "transformers"), settings=_SETTINGS,
    multiple=lambda heads: _SETTINGS["key_head_dim"], keep_words="Gated DeltaNet α a head")


class HFGatedDeltaNetFamily(StepEdits, DeltaForward, DeltaCell, OfficialFamily):
    """One Gated DeltaNet layer of a Qwen3-Next / Qwen3.5 / OLMo Hybrid model."""

    name = "hf-gated-deltanet"
    opens_what = ("transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo Hybrid; "
                  "each linear_attn inside the whole model)")
    specs = (GATED_DELTANET, GATED_DELTANET_NEG)
    recipe = GDN_RECIPE
    units_name = "head"

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module) is GatedDeltaNetStack or (
            type(module).__module__, type(module).__name__) in CLASSES

    @property
    def _stack(self) -> bool:
        return isinstance(self.module, GatedDeltaNetStack)

    def layers(self, m: nn.Module) -> list[nn.Module]:
        """The Gated DeltaNet layers of ``m`` (the module or its float64 copy), bottom up."""
        return list(m.layers) if isinstance(m, GatedDeltaNetStack) else [m]

    # ---- facts ---------------------------------------------------------------------
    @property
    def cell_name(self) -> str:  # type: ignore[override]
        return GATED_DELTANET_NEG.name if self._neg else GATED_DELTANET.name

    @property
    def _neg(self) -> bool:
        return bool(getattr(self.layers(self.module)[0], "allow_neg_eigval", False))

    @property
    def num_layers(self) -> int:
        return len(self.layers(self.module))

    @property
    def hidden_size(self) -> int:
        return self.shape[1]

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(H_k, H_v, d_k, d_v, d_conv, conv channels), the same in every layer."""
        m = self.layers(self.module)[0]
        return (int(m.num_k_heads), int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim),
                int(m.conv_kernel_size), int(m.conv_dim))

    def describe(self) -> dict:
        m = self.module
        Hk, Hv, dk, dv, K, _ = self.shape
        where = {} if self._stack else {
            "layer_index": int(m.layer_idx),
            "layer_type": str(getattr(m, "layer_type", "linear_attention")),
            "left_alone": "the model's attention, MLP and MoE layers (not recurrences); each "
                          "of its Gated DeltaNet layers is opened and measured on its own"}
        return {**super().describe(), **where, "key_heads": Hk, "value_heads": Hv,
                "key_dim": dk, "value_dim": dv, "conv_kernel": K}

    def state_units(self, k: int) -> Tensor:
        _, Hv, dk, dv, _, _ = self.shape
        return torch.arange(Hv).repeat_interleave(dv * dk)

    def part_units(self, k: int) -> list[Tensor]:
        _, _, _, _, K, cd = self.shape
        return [buffer_units(K, cd), self.state_units(k)]

    def input_window(self) -> int:
        return self.shape[4]

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        _, Hv, dk, dv, K, cd = self.shape
        return zeros64(self.module, batch, (K - 1) * cd, Hv * dv * dk)

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[1]

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args, kwargs):
        if self._stack:
            return super().split_call(args, kwargs)
        inputs = args[0] if args else kwargs.get("hidden_states")
        state = args[1] if len(args) > 1 else kwargs.get("cache_params")
        mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        if state is None and isinstance(mask, Tensor) and not bool(mask.all()):
            state = mask  # padding: refused by check, in one line
        return inputs, state

    def check(self, inputs, state=None) -> Call:
        if state is not None:
            raise GatelensError(
                f"{self.name}: a cache or a padding mask passed to "
                f"{type(self.module).__name__} is not supported; "
                "the analysis runs whole windows from the zero state")
        return OfficialFamily.check(self, inputs)

    # ---- the module's own computation ----------------------------------------------
    def _cache(self, batch: int, like: Tensor, primed: bool):
        """transformers' own cache for the layers; ``primed``: a zero conv window and a
        zero state already in each, so the first token takes the decode step too."""
        from transformers.cache_utils import Cache, LinearAttentionLayer

        (_, Hv, dk, dv, K, cd), idx = self.shape, [int(g.layer_idx) for g in self.layers(
            self.module)]
        cache = Cache(layers=[LinearAttentionLayer() for _ in range(max(idx) + 1)])
        for i in idx if primed else ():
            cache.update_conv_state(like.new_zeros(batch, cd, K), i)
            cache.update_recurrent_state(torch.zeros(batch, Hv, dk, dv, device=like.device), i)
        return cache

    def _run(self, x: Tensor, cache, record: list | None = None) -> Tensor:
        """The module on x (B, T', d) through its own layers with ``cache`` (``record``: per
        layer the block's input, the layer's input and output, the block's output)."""
        if not self._stack:
            y = self.module(hidden_states=x, cache_params=cache)
            if record is not None:
                record[0].append((x, x, y, y))
            return y
        m = self.module
        for k, (norm, layer) in enumerate(zip(m.norms, m.layers, strict=True)):
            u = norm(x)
            y = layer(hidden_states=u, cache_params=cache)
            if record is not None:
                record[k].append((x, u, y, x + y))
            x = x + y
        return m.norm_f(x)

    def _forward(self, call: Call) -> Tensor:
        return self._run(call.inputs, None)

    @staticmethod
    def _carried(layer) -> tuple[Tensor, Tensor]:
        """(conv buffer (B, 1, (K − 1)·conv_dim), S (B, 1, H_v·d_v·d_k)) a cache layer holds
        after a step: the next window's K − 1 inputs, oldest first; S from the package's Sᵀ."""
        conv = layer.conv_states[0][..., 1:]  # (B, conv_dim, K − 1)
        S = layer.recurrent_states[0]  # (B, H_v, d_k, d_v)
        B = S.shape[0]
        return (conv.transpose(1, 2).reshape(B, 1, -1).clone(),
                S.transpose(-1, -2).reshape(B, 1, -1).clone())

    def _trajectory(self, call: Call) -> dict:
        L, mods = self.num_layers, self.layers(self.module)
        cache = self._cache(call.batch, call.inputs, primed=True)
        record: list[list] = [[] for _ in range(L)]
        carried: list[list] = [[] for _ in range(L)]
        outs = []
        for t in range(call.length):
            outs.append(self._run(call.inputs[:, t : t + 1], cache, record))
            for k, g in enumerate(mods):
                carried[k].append(self._carried(cache.layers[g.layer_idx]))
        seq = [[torch.cat(z, dim=1) for z in zip(*record[k], strict=True)] for k in range(L)]
        return {"x": [r[0] for r in seq], "u": [r[1] for r in seq], "y": [r[2] for r in seq],
                "xo": [r[3] for r in seq], "aux": [None] * L, "output": torch.cat(outs, 1),
                "parts": [[torch.cat(z, dim=1) for z in zip(*carried[k], strict=True)]
                          for k in range(L)]}

    def reference(self, call: Call) -> Reference:
        ref = super().reference(call)
        own = ref.extra["own"]
        if own is not None:  # the chunked prefill's final states, left by the same forward
            finals = [o.pop("final")[:, None] for o in own]  # (B, 1, S) each
        else:
            with torch.no_grad():
                cache = self._cache(call.batch, call.inputs, primed=False)
                self._run(call.inputs, cache)  # the chunked prefill
            finals = [self._carried(cache.layers[g.layer_idx])[1]
                      for g in self.layers(self.module)]
        ref.final = torch.cat(finals, dim=-1)[:, 0]
        diffs = [scaled_diff(f, ref.extra["parts"][k][1][:, -1:])
                 for k, f in enumerate(finals)]
        ref.extra["final_vs_step"] = worst_of(diffs)
        return ref

    # ---- the hand cell ---------------------------------------------------------------
    def _project(self, m: nn.Module, u: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(the conv's input q k v (N, conv_dim), z (N, H_v·d_v), b (N, H_v), a (N, H_v)),
        each variant's projections as its forward takes them."""
        if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: fused, grouped by key head
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(u)[:, None],
                                                              m.in_proj_ba(u)[:, None])
            qkv = torch.cat([x.reshape(x.shape[0], -1) for x in (q, k, v)], dim=-1)
            return qkv, z.reshape(z.shape[0], -1), b[:, 0], a[:, 0]
        if hasattr(m, "in_proj_qkv"):  # Qwen3.5
            return m.in_proj_qkv(u), m.in_proj_z(u), m.in_proj_b(u), m.in_proj_a(u)
        qkv = torch.cat([m.q_proj(u), m.k_proj(u), m.v_proj(u)], dim=-1)  # OLMo Hybrid
        return qkv, m.g_proj(u), m.b_proj(u), m.a_proj(u)

    def _qkv(self, m: nn.Module, u: Tensor) -> Tensor:
        """The convolution's input (R, conv_dim) from R rows of the layer's input."""
        return self._project(m, u)[0]

    def _inputs(self, m: nn.Module, u: Tensor, xc: Tensor) -> dict[str, Tensor]:
        """A step's input side, R rows (it reads no state): the trace's alpha, beta, k, v
        (R, ·) from u (R, F) and the activated convolution xc; the scaled query q
        (R, H_v, d_k) and the output gate (R, H_v, d_v) for the read-out."""
        Hk, Hv, dk, dv, _, _ = self.shape
        _, z, b, a = self._project(m, u)
        q, key, v = torch.split(xc, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q = _l2norm(q.view(-1, Hk, dk).repeat_interleave(Hv // Hk, dim=1)) * dk ** -0.5
        key = _l2norm(key.view(-1, Hk, dk).repeat_interleave(Hv // Hk, dim=1))  # (R, H_v, d_k)
        A = torch.exp(m.A_log.float()).to(u.dtype)  # (H_v,): in float32, as the package
        return {"alpha": torch.exp(-A * F.softplus(a + m.dt_bias)),  # (R, H_v)
                "beta": torch.sigmoid(b) * (2.0 if self._neg else 1.0),
                "k": key.reshape(-1, Hv * dk), "v": v, "q": q, "gate": z.view(-1, Hv, dv)}

    def pre(self, k, m, x):
        return m.norms[k](x) if isinstance(m, GatedDeltaNetStack) else x

    def post(self, k, m, x, y):
        return x + y if isinstance(m, GatedDeltaNetStack) else y

    def final(self, m, x):
        return m.norm_f(x) if isinstance(m, GatedDeltaNetStack) else x
