"""transformers' FalconMamba (``FalconMambaModel``, inside ``FalconMambaForCausalLM``; 5.23):
a Mamba-1 stack whose mixer normalises Δ's low-rank input, B and C before the scan.

The mixer is hf-mamba's (families/hf_mamba.py, the same cell and the same cache), with one
difference, as ``FalconMambaMixer`` computes it: after ``x_proj``,
  δ ← δ / rms(δ),  B ← B / rms(B),  C ← C / rms(C),   rms(v) = √(mean(v²) + ε)
(ε = ``mixer_rms_eps``; ``FalconMambaWeightlessRMSNorm``: no weight, the ones it holds are
a buffer its forward never reads), then Δ = softplus(dt_proj.weight δ + dt_proj.bias) and
the scan s_t = exp(Δ·A) s_{t−1} + Δ B x̂ as in Mamba. The package takes each norm in float32
(``x.float()``), and the blocks' RMSNorms too; the hand cell takes them all in the dtype it
runs in (float64 for the read-out).
The reference is the model run one token at a time with its own cache (its
``selective_state_update``), the whole-sequence CPU scan compared with it
(``step_vs_forward``). Edits (``Lens.run``) are hf-mamba's (families/official_edit.py).

>>> import torch
>>> from transformers import FalconMambaConfig, FalconMambaModel
>>> cfg = FalconMambaConfig(vocab_size=7, hidden_size=8, state_size=4, num_hidden_layers=1,
...                         expand=2, conv_kernel=3, time_step_rank=2)
>>> fam = HFFalconMambaFamily(FalconMambaModel(cfg))
>>> call = fam.check(torch.randint(0, 7, (2, 6)))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.families.base import Call, Reference
from gatelens.families.hf_mamba import HFMambaFamily
from gatelens.families.official import scaled_diff

_HF = "transformers.models.falcon_mamba.modeling_falcon_mamba"


def rms(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """x / √(mean(x²) + ε) over the last axis (times ``weight`` where given), in x's dtype.

    >>> rms(torch.tensor([[3.0, 4.0]]), 0.0).tolist()  # mean(x²) = 12.5
    [[0.8485281467437744, 1.1313709020614624]]
    """
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else weight.to(x.dtype) * out


class HFFalconMambaFamily(HFMambaFamily):
    """transformers' ``FalconMambaModel`` (``FalconMambaForCausalLM.backbone``)."""

    name = "hf-falcon-mamba"
    opens_what = ("transformers' FalconMambaModel / FalconMambaForCausalLM (Mamba-1 with "
                  "RMS norms on Δ, B and C)")
    recipe = None  # opened, not trained (hf-mamba trains the plain Mamba-1)

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == _HF and type(module).__name__ == "FalconMambaModel"

    def _bcdt(self, mixer: nn.Module, dt: Tensor, B: Tensor, C: Tensor):
        eps = float(mixer.rms_eps)
        return rms(dt, eps), rms(B, eps), rms(C, eps)

    def reference(self, call: Call) -> Reference:
        from transformers import DynamicCache

        ref = super().reference(call)
        cache = DynamicCache(config=self.module.config)
        with torch.no_grad():  # the whole-sequence scan, its final state left in the cache
            self.module(inputs_embeds=call.inputs, cache_params=cache, use_cache=True)
        finals = [cache.get_recurrent_state(k).reshape(call.batch, 1, -1)
                  for k in range(self.num_layers)]  # (B, 1, d_inner·N) each
        ref.final = torch.cat(finals, dim=-1)[:, 0]
        diffs = [scaled_diff(f, ref.extra["parts"][k][1][:, -1:]) for k, f in enumerate(finals)]
        ref.extra["final_vs_step"] = (max(d[0] for d in diffs), max(d[1] for d in diffs))
        return ref

    # the blocks' RMSNorms in the hand cell's dtype (the package rounds them to float32)
    def pre(self, k, m, x):
        norm = m.layers[k].norm
        return rms(x, norm.variance_epsilon, norm.weight)

    def final(self, m, x):
        return rms(x, m.norm_f.variance_epsilon, m.norm_f.weight)
