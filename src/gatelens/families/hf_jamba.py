"""transformers' Jamba (5.23): its Mamba-1 mixers (``JambaMambaMixer``), each opened where
it sits inside the whole model (``model.layers.K.mamba`` of ``JambaForCausalLM``); the
attention layers, the MLPs and the MoE blocks around them are left alone.

The mixer is hf-mamba's selective scan (families/hf_mamba.py, ``MambaCell``: the same cell,
read from the same weights) with Jamba's three weighted RMS norms after ``x_proj``, as
``JambaMambaMixer`` computes them:
  δ ← w_δ ⊙ δ / rms(δ),  B ← w_B ⊙ B / rms(B),  C ← w_C ⊙ C / rms(C)
(``dt_layernorm``, ``b_layernorm``, ``c_layernorm``; rms(v) = √(mean(v²) + ε), ε =
``rms_norm_eps``; the package takes them in float32, the hand cell in its own dtype), then
Δ = softplus(dt_proj.weight δ + dt_proj.bias), s_t[d, n] = exp(Δ_d A_dn) s_{t−1}[d, n] +
Δ_d B_n x̂_d, y = out_proj((C · s[d, :] + D_d x̂_d) ⊙ silu(z)). The units are the (channel,
state) pairs, the keep exp(Δ·A); the input enters s through the conv's window of d_conv.

The states come from one whole-sequence forward (given a fresh cache, so that it leaves its
final state too; ``final_vs_step``), read as FalconMamba's are (hf_falcon_mamba.normed_scan:
the package's sequential scan replayed on what x_proj, the norms and in_proj returned, its
output against the mixer's as ``step_vs_forward``). A mixer on a fused kernel is read on its
decode path: its own forward one token at a time with transformers' own cache, primed with
a zero conv window and state (``causal_conv1d_update``, ``selective_state_update``). Edits
(``Lens.run``) are hf-mamba's (families/official_edit.py) on the one layer, the mixer's
output replaced in the whole model's forward.

>>> import torch
>>> from transformers import JambaConfig, JambaForCausalLM
>>> cfg = JambaConfig(vocab_size=7, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
...     num_attention_heads=2, num_key_value_heads=1, num_experts=1, attn_layer_period=2,
...     attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_dt_rank=2)
>>> model = JambaForCausalLM(cfg)
>>> [HFJambaFamily.opens(m) for m in (model.model.layers[0].mamba, model.model.layers[1])]
[True, False]
>>> fam = HFJambaFamily(model.model.layers[0].mamba)
>>> call = fam.check(torch.randn(2, 6, 8))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call, Reference
from gatelens.families.forward_scan import SequentialScanStates
from gatelens.families.hf_falcon_mamba import normed_hooks, normed_path, normed_scan, rms
from gatelens.families.hf_mamba import MambaCell
from gatelens.families.official import OfficialFamily, Recorder, conv_buffer, scaled_diff

_HF = "transformers.models.jamba.modeling_jamba"


class HFJambaFamily(MambaCell):
    """One Mamba-1 mixer of a Jamba model (``JambaMambaMixer``, ``model.layers.K.mamba``)."""

    name = "hf-jamba"
    opens_what = ("transformers' Jamba Mamba-1 mixers (each JambaMambaMixer inside the whole "
                  "JambaForCausalLM)")

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == _HF and type(module).__name__ == "JambaMambaMixer"

    def mixers(self, m: nn.Module) -> list[nn.Module]:
        return [m]

    def describe(self) -> dict:
        return {**super().describe(), "layer_index": int(self.module.layer_idx),
                "state_size": self.d_state, "conv_kernel": self.d_conv,
                "left_alone": "the model's attention, MLP and MoE layers (not recurrences); "
                              "each of its Mamba layers is opened and measured on its own"}

    def _act(self, mixer: nn.Module, x: Tensor) -> Tensor:
        return mixer.act(x)

    def _bcdt(self, mixer: nn.Module, dt: Tensor, B: Tensor, C: Tensor):
        return tuple(rms(v, norm.variance_epsilon, norm.weight) for v, norm in (
            (dt, mixer.dt_layernorm), (B, mixer.b_layernorm), (C, mixer.c_layernorm)))

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict):
        """(hidden_states, the cache, or a padding mask where one masks anything)."""
        inputs = args[0] if args else kwargs.get("hidden_states")
        state = args[1] if len(args) > 1 else kwargs.get("cache_params")
        mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
        if state is None and isinstance(mask, Tensor) and not bool(mask.all()):
            state = mask  # padding: refused by check, in one line
        return inputs, state

    def check(self, inputs: Any, state: Any = None) -> Call:
        if state is not None:
            raise GatelensError(
                f"{self.name}: a cache or a padding mask passed to JambaMambaMixer (got "
                f"{type(state).__name__}) is not supported; the analysis runs whole windows "
                "from the zero state")
        return OfficialFamily.check(self, inputs)

    # ---- the module's own computation ------------------------------------------------
    def _forward(self, call: Call) -> Tensor:
        return self.module(call.inputs)

    def own_output(self, call: Call) -> Tensor:
        """What the mixer returns for the call (no cache)."""
        return self.module(call.inputs)

    def _cache(self, batch: int, like: Tensor, primed: bool):
        """transformers' own cache for the model; ``primed``: a zero conv window and a zero
        state in this mixer's layer, so the first token takes the decode step too."""
        from transformers import DynamicCache

        mix, idx = self.module, int(self.module.layer_idx)
        cache = DynamicCache(config=mix.config)
        if primed:
            cache.update_conv_state(like.new_zeros(batch, self.d_inner, self.d_conv), idx)
            cache.update_recurrent_state(torch.zeros(
                batch, self.d_inner, self.d_state, device=like.device,
                dtype=torch.promote_types(like.dtype, torch.float32)), idx)
        return cache

    def _carried(self, cache, batch: int) -> tuple[Tensor, Tensor]:
        """(conv buffer (B, 1, (K − 1)·d_inner), s (B, 1, d_inner·N)) after a step."""
        idx = int(self.module.layer_idx)
        conv = cache.get_conv_state(idx)[..., 1:]  # (B, d_inner, K − 1), oldest first
        s = cache.get_recurrent_state(idx)  # (B, d_inner, N)
        return (conv.transpose(1, 2).reshape(batch, 1, -1).clone(),
                s.reshape(batch, 1, -1).clone())

    def _trajectory(self, call: Call) -> dict:
        B, x = call.batch, call.inputs
        cache = self._cache(B, x, primed=True)
        outs, carried = [], []
        for t in range(call.length):
            outs.append(self.module(x[:, t : t + 1], cache_params=cache))
            carried.append(self._carried(cache, B))
        y = torch.cat(outs, dim=1)
        return {"x": [x], "u": [x], "y": [y], "xo": [y], "aux": [None], "output": y,
                "parts": [[torch.cat(p, dim=1) for p in zip(*carried, strict=True)]]}

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """The mixer and the module calls ``normed_scan`` reads; None on a fused kernel."""
        return {**normed_hooks(self.module, 0), "module": self.module} \
            if normed_path(self.module) else None

    def scan_steps(self) -> dict[str, tuple[nn.Module, type]] | None:
        """The mixer, with ``SequentialScanStates`` active in it: its sequential scan's own
        states are kept as it forms them (``normed_scan``), so none is replayed."""
        return {"scan0": (self.module, SequentialScanStates)} if normed_path(self.module) \
            else None

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        return self._recorded(rec, output, None)

    def _forward_trajectory(self, call: Call) -> dict | None:
        """``trajectory_recorded`` of the whole-sequence forward given a fresh cache, so that
        it leaves its final state too (``own``'s "final", ``final_vs_step``)."""
        mods = self.scan_modules()
        if mods is None:
            return None
        cache = self._cache(call.batch, call.inputs, primed=False)
        with Recorder(mods, self.scan_steps()) as rec:
            output = self.module(call.inputs, cache_params=cache)
        return self._recorded(rec, output, cache)

    def _recorded(self, rec: Recorder, output: Tensor, cache) -> dict:
        """The states by hf_falcon_mamba.normed_scan; ``cache``: the forward's, or None."""
        sig, x, s, gap = normed_scan(self.module, rec, 0)
        if cache is not None:
            sig["final"] = self._carried(cache, output.shape[0])[1][:, 0]
        inputs = rec.stacked("module")
        return {"x": [inputs], "u": [inputs], "y": [output], "xo": [output],
                "parts": [[conv_buffer(x, self.d_conv), s]], "aux": [None], "output": output,
                "own": [sig], "step_vs_forward": gap}

    def reference(self, call: Call) -> Reference:
        ref = super().reference(call)
        if ref.extra["own"] is not None:  # the whole-sequence scan's, from the same forward
            final = ref.extra["own"][0].pop("final")[:, None]
        else:
            with torch.no_grad():
                cache = self._cache(call.batch, call.inputs, primed=False)
                self.module(call.inputs, cache_params=cache)  # the whole-sequence scan
            final = self._carried(cache, call.batch)[1]  # (B, 1, S)
        ref.final = final[:, 0]
        ref.extra["final_vs_step"] = scaled_diff(final, ref.extra["parts"][0][1][:, -1:])
        return ref

    # ---- the block around the cell: none (the decoder layer is left alone) ------------
    def pre(self, k, m, x):
        return x

    def post(self, k, m, x, y):
        return y

    def final(self, m, x):
        return x
