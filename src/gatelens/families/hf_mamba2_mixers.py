"""transformers' Mamba-2 mixers inside the hybrids (5.23): ``BambaMixer`` (Bamba),
``Zamba2MambaMixer`` (Zamba2), ``FalconH1Mixer`` (Falcon-H1), ``GraniteMoeHybridMambaLayer``
(Granite 4.0 hybrids) and ``NemotronHMamba2Mixer`` (Nemotron-H), each opened where it sits
inside the whole model (``model.layers.K.mamba``; Zamba2's hybrid layers
``model.layers.K.mamba_decoder.mamba``, Nemotron-H's ``model.layers.K.mixer``) and named by
its index K in the whole stack. The attention, MLP and MoE layers between them, Zamba2's
shared transformer blocks (one set of weights called from several hybrid layers) and
Falcon-H1's attention beside its mixer in the same layer are left alone.

Each is Mamba-2's mixer (families/hf_mamba2.py, ``mamba2_step``): g, xBC, δ = in_proj(u);
xBC ← act(causal depthwise conv(xBC)) split into x, B, C (n_groups × state each, a group
serving heads / n_groups heads); Δ_h = softplus(δ_h + dt_bias_h), a_h = exp(Δ_h A_h),
A = −exp(A_log) in float32; s_t[h] = a_h s_{t−1}[h] + Δ_h x_t[h] ⊗ B_t[g];
y = out_proj(GatedRMSNorm(s_t[h] C_t[g] + D_h x_t[h], g)), the norm over each of n_groups
groups of the inner width. Their differences, as their forwards take them:

- Bamba, GraniteMoeHybrid, NemotronH, Zamba2: the same forward (Zamba2's conv act is silu;
  Zamba2 and NemotronH clamp Δ to ≥ time_step_min in their chunked path only);
- FalconH1: u × ``ssm_in_multiplier`` before in_proj and in_proj's output × ``mup_vector``
  (its μP multipliers for g, x, B, C, δ); the gated norm only where ``mamba_rms_norm``
  (``norm_before_gate`` either way), y ⊙ silu(g) otherwise. ``ssm_out_multiplier`` scales
  the mixer's output outside it, in the decoder layer (a link of the model, not of the cell).

The units are the heads (one decay a head for head_dim × state entries of s); the input
enters s through the conv's window of d_conv tokens. The states come from one
whole-sequence forward (the chunked ``mamba2_chunk_scan``, chunk_size tokens a chunk, given
a fresh cache so that it leaves its final state): hooks on in_proj, the package's own
convolution on what it returned, and the decode step's recurrence
(``mamba2_selective_state_update``, which takes no Δ clamp, so the family takes none)
replayed on it (``hf_mamba2.mamba2_replay``); the chunked output against the replay is
``step_vs_forward``, the chunked final state ``final_vs_step``. A mixer on a fused kernel is
read on its decode path: its own forward one token at a time with transformers' own cache
(``causal_conv1d_update`` and the same decode step), from a zero conv window and state.

>>> import torch
>>> from transformers import BambaConfig, BambaForCausalLM
>>> cfg = BambaConfig(vocab_size=7, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
...     num_attention_heads=2, num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=2,
...     mamba_d_head=8, mamba_d_state=4, mamba_d_conv=3, mamba_chunk_size=4)
>>> model = BambaForCausalLM(cfg)
>>> fam = HFMamba2MixerFamily(model.model.layers[0].mamba)
>>> call = fam.check(torch.randn(2, 6, 8))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call, Reference
from gatelens.families.buffers import zeros64
from gatelens.families.delta_scan import prompt_conv, torch_path
from gatelens.families.hf_mamba2 import MAMBA2, mamba2_replay, mamba2_scan, mamba2_step
from gatelens.families.official import (
    OfficialFamily,
    Recorder,
    buffer_units,
    conv_buffer,
    scaled_diff,
)

_M = "transformers.models."
#: the mixer classes opened, by module path (transformers stays unimported until one is)
CLASSES = {
    (_M + "bamba.modeling_bamba", "BambaMixer"),
    (_M + "zamba2.modeling_zamba2", "Zamba2MambaMixer"),
    (_M + "falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
    (_M + "granitemoehybrid.modeling_granitemoehybrid", "GraniteMoeHybridMambaLayer"),
    (_M + "nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
}
#: what each model holds besides its Mamba-2 mixers, left alone (describe()'s words)
LEFT_ALONE = {
    "BambaMixer": "the attention layers and MLPs",
    "Zamba2MambaMixer": "the shared transformer blocks (one attention + MLP block's weights "
                        "called from several hybrid layers) and their linear adapters",
    "FalconH1Mixer": "the attention beside each mixer in the same layer, the MLPs and the "
                     "μP multipliers outside the mixer (ssm_out_multiplier)",
    "GraniteMoeHybridMambaLayer": "the attention layers, the MoE and shared MLPs",
    "NemotronHMamba2Mixer": "the attention, MLP and MoE layers",
}


class HFMamba2MixerFamily(OfficialFamily):
    """One Mamba-2 mixer of a Bamba / Zamba2 / FalconH1 / GraniteMoeHybrid / NemotronH."""

    name = "hf-mamba2-mixer"
    opens_what = ("transformers' Mamba-2 mixers inside Bamba, Zamba2, FalconH1, "
                  "GraniteMoeHybrid and NemotronH (each mixer inside the whole model)")
    cell_name = "mamba2"
    specs = (MAMBA2,)
    units_name = "head"

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return (type(module).__module__, type(module).__name__) in CLASSES

    # ---- facts ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return 1

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(heads, head_dim, state size, d_conv, conv channels)."""
        m = self.module
        return (int(m.num_heads), int(m.head_dim), int(m.ssm_state_size),
                int(m.conv1d.weight.shape[-1]), int(m.conv_dim))

    @property
    def hidden_size(self) -> int:
        return self.shape[0]

    @property
    def _falcon(self) -> bool:
        return hasattr(self.module, "mup_vector")

    def describe(self) -> dict:
        m, (NH, P, N, K, _) = self.module, self.shape
        info = {"layer_index": int(m.layer_idx),
                "layer_type": str(getattr(m, "layer_type", "linear_attention")),
                "left_alone": f"{LEFT_ALONE[type(m).__name__]} (not recurrences); each of "
                              "the model's Mamba-2 mixers is opened and measured on its own",
                "heads": NH, "head_dim": P, "state_size": N, "groups": int(m.n_groups),
                "conv_kernel": K, "chunk_size": int(m.chunk_size)}
        if self._falcon:
            info["multipliers"] = {"ssm_in": float(m.ssm_in_multiplier),
                                   "gated_norm": bool(m.mamba_rms_norm)}
        return {**super().describe(), **info}

    def state_units(self, k: int) -> Tensor:
        NH, P, N, _, _ = self.shape
        return torch.arange(NH).repeat_interleave(P * N)

    def part_units(self, k: int) -> list[Tensor]:
        _, _, _, K, cd = self.shape
        return [buffer_units(K, cd), self.state_units(k)]

    def input_window(self) -> int:
        return self.shape[3]

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        NH, P, N, K, cd = self.shape
        return zeros64(self.module, batch, (K - 1) * cd, NH * P * N)

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[1]

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args, kwargs):
        inputs = args[0] if args else kwargs.get("hidden_states")
        state = args[1] if len(args) > 1 else kwargs.get("cache_params")
        mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        if state is None and isinstance(mask, Tensor) and not bool(mask.all()):
            state = mask  # padding: refused by check, in one line
        return inputs, state

    def check(self, inputs, state=None) -> Call:
        if state is not None:
            m = self.module
            raise GatelensError(
                f"{self.name}: layer {m.layer_idx} ({type(m).__name__}) was called with a "
                "cache or a padding mask, which is not supported; the analysis runs whole "
                "windows from the zero state")
        return OfficialFamily.check(self, inputs)

    # ---- the module's own computation ----------------------------------------------
    def _cache(self, batch: int, like: Tensor, primed: bool):
        """transformers' own cache for the mixer's layer; ``primed``: a zero conv window
        and a zero state (float32, as the package's chunked prefill leaves it) already in
        it, so the first token takes the decode step too."""
        from transformers.cache_utils import Cache, LinearAttentionLayer

        (NH, P, N, K, cd), i = self.shape, int(self.module.layer_idx)
        cache = Cache(layers=[LinearAttentionLayer() for _ in range(i + 1)])
        if primed:
            cache.update_conv_state(like.new_zeros(batch, cd, K), i)
            cache.update_recurrent_state(
                torch.zeros(batch, NH, P, N, dtype=torch.float32, device=like.device), i)
        return cache

    def _carried(self, cache) -> tuple[Tensor, Tensor]:
        """(conv buffer (B, 1, (K − 1)·conv_dim), s (B, 1, heads·head_dim·state)) the cache
        holds after a step: the next window's K − 1 inputs, oldest first, and s."""
        layer = cache.layers[int(self.module.layer_idx)]
        conv = layer.conv_states[0][..., 1:]  # (B, conv_dim, K − 1)
        s = layer.recurrent_states[0]  # (B, heads, head_dim, state)
        B = s.shape[0]
        return (conv.transpose(1, 2).reshape(B, 1, -1).clone(), s.reshape(B, 1, -1).clone())

    def _forward(self, call: Call) -> Tensor:
        return self.module(hidden_states=call.inputs)

    def _trajectory(self, call: Call) -> dict:
        x = call.inputs
        cache = self._cache(call.batch, x, primed=True)
        outs, carried = [], []
        for t in range(call.length):
            outs.append(self.module(hidden_states=x[:, t : t + 1], cache_params=cache))
            carried.append(self._carried(cache))
        y = torch.cat(outs, dim=1)
        return {"x": [x], "u": [x], "y": [y], "xo": [y], "aux": [None], "output": y,
                "parts": [[torch.cat(z, dim=1) for z in zip(*carried, strict=True)]]}

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """The mixer, its in_proj and its gated norm (FalconH1 without it: out_proj), whose
        calls in one whole-sequence forward give every state; None where the mixer's file
        runs a fused kernel."""
        mix = self.module
        if not torch_path(mix, ("causal_conv1d_fn", "mamba2_chunk_scan",
                                "mamba2_selective_state_update")):
            return None
        last = ("norm", mix.norm) if self._normed else ("out", mix.out_proj)
        return {"module": mix, "in": mix.in_proj, last[0]: last[1]}

    @property
    def _normed(self) -> bool:
        return not self._falcon or bool(self.module.mamba_rms_norm)

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        return self._recorded(rec, output, None)

    def _forward_trajectory(self, call: Call) -> dict | None:
        """``trajectory_recorded`` of the chunked prefill given a fresh cache, so that the
        same forward leaves its final state too (``own``'s "final", ``final_vs_step``)."""
        mods = self.scan_modules()
        if mods is None:
            return None
        cache = self._cache(call.batch, call.inputs, primed=False)
        with Recorder(mods) as rec:
            output = self.module(hidden_states=call.inputs, cache_params=cache)
        return self._recorded(rec, output, cache)

    def _recorded(self, rec: Recorder, output: Tensor, cache) -> dict:
        """The file's own ``causal_conv1d_fn`` on what in_proj returned (× FalconH1's
        ``mup_vector``, as its forward), and the decode step's recurrence replayed on it
        (``hf_mamba2.mamba2_replay``: the file's ``mamba2_selective_state_update`` is
        Mamba-2's). The chunked scan's output against the replay's is ``step_vs_forward``
        (Zamba2's and NemotronH's Δ clamp, which only their chunked path applies, shows there
        as it did against the decode path). ``cache``: the one the forward was given, or None."""
        mix = self.module
        zxbcdt = rec.stacked("in", outputs=True)  # (B, T, inner + conv_dim + heads)
        if self._falcon:
            zxbcdt = zxbcdt * mix.mup_vector
        gate, xbc, _ = zxbcdt.split([mix.intermediate_size, mix.conv_dim, mix.num_heads], -1)
        sig, s, y = mamba2_replay(mix, zxbcdt, prompt_conv(mix, xbc, cache is not None))
        gap = scaled_diff(y, rec.stacked("norm")) if self._normed else \
            scaled_diff(y * F.silu(gate), rec.stacked("out"))
        if cache is not None:
            sig["final"] = self._carried(cache)[1][:, 0]
        x = rec.stacked("module")
        return {"x": [x], "u": [x], "y": [output], "xo": [output],
                "parts": [[conv_buffer(xbc, self.shape[3]), s]], "aux": [None],
                "output": output, "own": [sig], "step_vs_forward": gap}

    def reference(self, call: Call) -> Reference:
        ref = super().reference(call)
        if ref.extra["own"] is not None:  # the chunked prefill's, from the same forward
            final = ref.extra["own"][0].pop("final")[:, None]
        else:
            with torch.no_grad():
                cache = self._cache(call.batch, call.inputs, primed=False)
                self.module(hidden_states=call.inputs, cache_params=cache)  # chunked prefill
            final = self._carried(cache)[1]  # (B, 1, S)
        ref.final = final[:, 0]
        ref.extra["final_vs_step"] = scaled_diff(final, ref.extra["parts"][0][1][:, -1:])
        return ref

    # ---- the hand cell ---------------------------------------------------------------
    def _projected(self, m: nn.Module, u: Tensor):
        """in_proj's output and what stands between the scan and out_proj (FalconH1's μP
        multipliers, and its y ⊙ silu(g) where it has no gated norm)."""
        if not hasattr(m, "mup_vector"):
            return m.in_proj(u), None
        gated = None if m.mamba_rms_norm else (lambda y, g: y * F.silu(g))
        return m.in_proj(u * m.ssm_in_multiplier) * m.mup_vector.reshape(-1), gated

    def step_cell(self, k, m, u, parts, aux, edit=None):
        zxbcdt, gated = self._projected(m, u)
        return mamba2_step(m, zxbcdt, parts, edit, gated=gated)

    def scan_layer(self, k, m, u):
        zxbcdt, gated = self._projected(m, u)
        return mamba2_scan(m, zxbcdt, gated=gated)

    def own_output(self, call: Call) -> Tensor:
        """What the mixer returns for the call, with no cache."""
        return self._forward(call)

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0):
        """Edits inside the hand cell's steps from the first edited position on
        (families/official_edit.py); the mixer's own run before it."""
        from gatelens.families.official_edit import intervene

        return intervene(self, call, plan, output, offset)

    def pre(self, k, m, x):
        return x

    def post(self, k, m, x, y):
        return y
