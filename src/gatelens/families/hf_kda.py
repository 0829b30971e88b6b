"""transformers' KDA layer (Kimi Delta Attention, 5.23): ``KimiLinearDeltaAttention``, the
linear-attention layer of Kimi-Linear, opened where it sits inside the whole
``KimiLinearForCausalLM`` (``model.layers.K.self_attn``); the MLA attention layers, the
MLPs and the MoE blocks are left alone.

The layer, per head h (H heads of d = ``linear_head_dim`` for queries, keys and values
alike), as the package computes it:
  q, k, v ← act(causal depthwise conv(W_q u, W_k u, W_v u))  (d_conv taps, no bias; silu);
  β = σ(W_b u)  (one per head);
  g = −exp(A_log_h) · softplus(W_fb W_fa u + dt_bias)  (one per channel of the key
      dimension: H·d of them; softplus as the package writes it, log(1 + eᶻ) below 20),
  α = exp(g);
  k ← k / √(Σ k² + ε),  q likewise and / √d  (ε = 1e-6);
  S_t = S_{t−1} Diag(α_t) (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,  S ∈ R^(d × d) (d_v × d_k):
      the package decays its state first, then reads S k from the decayed state;
  o_t = S_t q_t;  y = o_proj(RMSNorm(o_t) · w ⊙ σ(W_gb W_ga u))  (per head, over d_v; the
      output gate is a sigmoid, not Gated DeltaNet's silu).
The trace holds S as METHODS writes it, (d_v × d_k) per head, flattened head by head (the
package's cache holds Sᵀ, (d_k × d_v)). The keep operator is
A_t(S) = S Diag(α_t) (I − β_t k_t k_tᵀ) (``kda_keep``: the perturbation split's forget path
applies it, a matrix product); the keep gate is α per channel (the units are the H·d key
channels, each S column's own decay), the write strength β per head, the written vector v.

The per-token states, the cache and the chunked path are Gated DeltaNet's
(families/hf_gated_deltanet.py, whose family this one extends): one whole-sequence forward
(``chunk_kimi_delta_attention``, chunks of 64) with hooks on the projections and the forget
gate, and the package's recurrent step (``recurrent_kimi_delta_attention``, what its decode
path calls) replayed on what they returned (families/delta_scan.py), bit for bit that
function over the window; the chunked output against it is ``step_vs_forward``, the chunked
final state ``final_vs_step``. A layer running a fused kernel is read on its decode path.
The package computes g, the delta rule and the gated norm in float32 whatever the model's
dtype. No ``--cell`` recipe: the family opens Kimi-Linear's layers.

>>> import torch
>>> from transformers import KimiLinearConfig, KimiLinearForCausalLM
>>> cfg = KimiLinearConfig(vocab_size=7, hidden_size=16, intermediate_size=16,
...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=4,
...     qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, linear_num_heads=2,
...     linear_head_dim=4, linear_conv_kernel_dim=3, mlp_layer_types=["dense", "dense"],
...     layer_types=["linear_attention", "full_attention"], pad_token_id=0)
>>> model = KimiLinearForCausalLM(cfg)
>>> fam = HFKDAFamily(model.model.layers[0].self_attn)
>>> call = fam.check(torch.randn(2, 6, 16))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.families.delta_scan import KDA_PACKAGE
from gatelens.families.hf_gated_deltanet import HFGatedDeltaNetFamily, _l2norm
from gatelens.families.official import OfficialFamily
from gatelens.families.spec import SIGMOID, CellSpec

#: the class opened, by module path (transformers stays unimported until one is opened)
CLASSES = {("transformers.models.kimi_linear.modeling_kimi_linear",
            "KimiLinearDeltaAttention")}


def kda_keep(signals: dict[str, Tensor], s: Tensor) -> Tensor:
    """The keep operator of one step on a carried state: A_t(S) = S Diag(α_t) (I − β_t k_t
    k_tᵀ) per head. ``signals``: that step's ``alpha`` (N, H·d_k: one a key channel),
    ``beta`` (N, H), ``k`` (N, H·d_k); ``s`` (N, H·d_v·d_k), each head's S (d_v × d_k) row
    by row.

    >>> sig = {"alpha": torch.tensor([[0.5, 1.0]]), "beta": torch.tensor([[1.0]]),
    ...        "k": torch.tensor([[0.0, 1.0]])}
    >>> kda_keep(sig, torch.tensor([[2.0, 3.0]])).tolist()  # halve column 0, erase k's
    [[1.0, 0.0]]
    """
    alpha, beta, k = signals["alpha"], signals["beta"], signals["k"]
    N, H = beta.shape
    dk = k.shape[-1] // H
    S = s.reshape(N, H, -1, dk) * alpha.reshape(N, H, 1, dk)  # S Diag(α): column j by α_j
    kk = k.reshape(N, H, 1, dk)
    Sk = (S * kk).sum(dim=-1, keepdim=True)  # (N, H, d_v, 1): (S Diag(α)) k
    return (S - beta[..., None, None] * Sk * kk).reshape(N, -1)


#: KDA's cell: α per key channel, β per head
KDA = CellSpec(
    name="kda", kind="kda", chunks=("q", "k", "v"),
    signals=("alpha", "beta", "k", "v", "s", "y"), gates=("alpha", "beta"),
    keep_gate="alpha", input_gate=None, state="s", output="y",
    bounds={"alpha": SIGMOID, "beta": SIGMOID}, keep_operator=kda_keep,
    display={"alpha": "decay α = exp(g) per key channel", "beta": "write strength β per head"})


def _softplus(x: Tensor) -> Tensor:
    """The package's softplus: x above 20, log(1 + eˣ) below (not log1p)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class HFKDAFamily(HFGatedDeltaNetFamily):
    """One KDA layer (``KimiLinearDeltaAttention``) of a Kimi-Linear model."""

    name = "hf-kda"
    opens_what = ("transformers' KDA layers (Kimi-Linear's KimiLinearDeltaAttention; each "
                  "self_attn inside the whole model)")
    specs = (KDA,)
    recipe = None
    package = KDA_PACKAGE
    units_name = "channel"

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return (type(module).__module__, type(module).__name__) in CLASSES

    # ---- facts ---------------------------------------------------------------------
    @property
    def cell_name(self) -> str:  # type: ignore[override]
        return KDA.name

    @property
    def _neg(self) -> bool:
        return False

    @property
    def hidden_size(self) -> int:
        """The units of one layer: its H·d key channels."""
        H, _, dk, _, _, _ = self.shape
        return H * dk

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(H, H, d, d, d_conv, conv channels): Gated DeltaNet's (H_k, H_v, d_k, d_v, ...),
        KDA's keys and values sharing the heads and the head size."""
        m = self.module
        H, d = int(m.num_heads), int(m.head_dim)
        return (H, H, d, d, int(m.conv_kernel_size), int(m.conv_dim))

    def describe(self) -> dict:
        m = self.module
        H, _, d, _, K, _ = self.shape
        return {**OfficialFamily.describe(self), "layer_index": int(m.layer_idx),
                "layer_type": str(getattr(m, "layer_type", "linear_attention")),
                "left_alone": "the model's MLA attention, MLP and MoE layers (not "
                              "recurrences); each of its KDA layers is opened and measured "
                              "on its own",
                "heads": H, "head_dim": d, "conv_kernel": K}

    def state_units(self, k: int) -> Tensor:
        """Each coordinate (h, i, j) of S (H × d_v × d_k) belongs to key channel h·d_k + j,
        whose α_j scales S's column j."""
        H, _, dk, dv, _, _ = self.shape
        return torch.arange(H * dk).view(H, 1, dk).expand(H, dv, dk).reshape(-1)

    # ---- the hand cell (families/delta_cell.py) ------------------------------------------
    def _qkv(self, m: nn.Module, u: Tensor) -> Tensor:
        return torch.cat([m.q_proj(u), m.k_proj(u), m.v_proj(u)], dim=-1)  # (R, conv_dim)

    def _inputs(self, m: nn.Module, u: Tensor, xc: Tensor) -> dict[str, Tensor]:
        """A step's input side, R rows: α (R, H·d_k: one a key channel), β (R, H), the
        normalised k and v (R, H·d), the scaled q (R, H, d) and the output gate (R, H, d)."""
        H, _, dk, dv, _, _ = self.shape
        q, key, v = torch.split(xc, [H * dk, H * dk, H * dv], dim=-1)
        fg = m.forget_gate
        A = torch.exp(fg.A_log.float()).to(u.dtype).view(1, H, 1)  # in float32, as the package
        g = -A * _softplus((fg.f_b_proj(fg.f_a_proj(u)) + fg.dt_bias).view(-1, H, dk))
        return {"alpha": torch.exp(g).reshape(-1, H * dk), "beta": torch.sigmoid(m.b_proj(u)),
                "k": _l2norm(key.view(-1, H, dk)).reshape(-1, H * dk), "v": v,
                "q": _l2norm(q.view(-1, H, dk)) * dk ** -0.5,
                "gate": m.g_b_proj(m.g_a_proj(u)).view(-1, H, dv)}
