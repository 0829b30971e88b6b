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
The states come from one whole-sequence forward, as hf-mamba's: hooks on each mixer's
in_proj, x_proj, three norms and out_proj, and the package's sequential CPU scan replayed on
what they returned (``normed_scan``: its states bit for bit; with ``use_mambapy``, its
parallel scan's rounding aside, the step's arithmetic; the output against the mixer's is
``step_vs_forward``); a mixer on a fused kernel is read on the decode path, the
model run one token at a time with its own cache (``selective_state_update``). Edits
(``Lens.run``) are hf-mamba's (families/official_edit.py).

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
from gatelens.families.delta_scan import torch_path
from gatelens.families.hf_mamba import HFMambaFamily, mamba1_scan
from gatelens.families.official import Recorder, conv_buffer, scaled_diff
from gatelens.families.records import worst_of

_HF = "transformers.models.falcon_mamba.modeling_falcon_mamba"


def rms(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """x / √(mean(x²) + ε) over the last axis (times ``weight`` where given), in x's dtype.

    >>> rms(torch.tensor([[3.0, 4.0]]), 0.0).tolist()  # mean(x²) = 12.5
    [[0.8485281467437744, 1.1313709020614624]]
    """
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else weight.to(x.dtype) * out


#: the mixer's norms after x_proj (Δ's low-rank input, B, C), module calls in both packages
NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def normed_hooks(mix: nn.Module, k: int) -> dict[str, nn.Module]:
    """The module calls of a Mamba-1 mixer with norms on Δ, B, C (FalconMamba's, Jamba's)
    that ``normed_scan`` reads, named for layer k."""
    return {f"in{k}": mix.in_proj, f"xp{k}": mix.x_proj, f"out{k}": mix.out_proj,
            **{f"{n}{k}": getattr(mix, n) for n in NORMS}}


def normed_path(mix: nn.Module) -> bool:
    """Whether the mixer runs its file's PyTorch scan (no fused kernel in its place, no
    quantised ``dt_proj`` the forward calls another way)."""
    return torch_path(mix, ("causal_conv1d_fn", "mamba_selective_scan",
                            "mamba_selective_state_update")) and \
        not hasattr(mix.config, "_is_quantized")


def normed_scan(mix: nn.Module, rec: Recorder, k: int
                ) -> tuple[dict[str, Tensor], Tensor, Tensor, tuple[float, float]]:
    """hf_mamba.mamba1_scan (the package's sequential scan, replayed) on what layer k's
    x_proj received and its three norms returned, with in_proj's gate: the signals, the
    convolution's input (B, T, d_inner), s (B, T, d_inner·N), and the replay's output
    against the one out_proj received (``step_vs_forward``)."""
    x, z = rec.stacked(f"in{k}", outputs=True).chunk(2, dim=-1)  # (B, T, d_inner) each
    normed = torch.cat([rec.stacked(f"{n}{k}", outputs=True) for n in NORMS], dim=-1)
    sig, s, y = mamba1_scan(mix, rec.stacked(f"xp{k}"), normed, z, rec.held(f"scan{k}"))
    return sig, x, s, scaled_diff(y, rec.stacked(f"out{k}"))


class HFFalconMambaFamily(HFMambaFamily):
    """transformers' ``FalconMambaModel`` (``FalconMambaForCausalLM.backbone``)."""

    name = "hf-falcon-mamba"
    opens_what = ("transformers' FalconMambaModel / FalconMambaForCausalLM (Mamba-1 with "
                  "RMS norms on Δ, B and C)")
    recipe = None  # opened, not trained (hf-mamba trains the plain Mamba-1)
    layers_apart = False  # its normed scan replays every layer together (``_recorded``)

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == _HF and type(module).__name__ == "FalconMambaModel"

    def _bcdt(self, mixer: nn.Module, dt: Tensor, B: Tensor, C: Tensor):
        eps = float(mixer.rms_eps)
        return rms(dt, eps), rms(B, eps), rms(C, eps)

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each block, its mixer and the module calls ``normed_scan`` reads; None where a
        mixer runs a fused kernel."""
        if not all(normed_path(mix) for mix in self.mixers(self.module)):
            return None
        mods: dict[str, nn.Module] = {}
        for k, block in enumerate(self.module.layers):
            mods.update({f"block{k}": block, f"mixer{k}": block.mixer,
                         **normed_hooks(block.mixer, k)})
        return mods

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        return self._recorded(rec, output, None)

    def _forward_trajectory(self, call: Call) -> dict | None:
        """``trajectory_recorded`` of the whole-sequence forward given a fresh cache, so that
        it leaves its final states too (``own``'s "final", ``final_vs_step``)."""
        from transformers import DynamicCache

        mods = self.scan_modules()
        if mods is None:
            return None
        cache = DynamicCache(config=self.module.config)
        with Recorder(mods, self.scan_steps()) as rec:
            output = self.module(inputs_embeds=call.inputs, cache_params=cache,
                                 use_cache=True).last_hidden_state
        return self._recorded(rec, output, cache)

    def _recorded(self, rec: Recorder, output: Tensor, cache) -> dict:
        """Each mixer's states by ``normed_scan``; ``cache``: the forward's, or None."""
        L = self.num_layers
        parts, own, gap = [], [], (0.0, 0.0)
        for k, mix in enumerate(self.mixers(self.module)):
            sig, x, s, d = normed_scan(mix, rec, k)
            gap = worst_of([gap, d])
            parts.append([conv_buffer(x, self.d_conv), s])
            if cache is not None:
                sig["final"] = cache.get_recurrent_state(k).reshape(output.shape[0], -1)
            own.append(sig)
        got = {n: [rec.stacked(f"{m}{k}", outputs=o) for k in range(L)]
               for n, m, o in (("x", "block", False), ("u", "mixer", False),
                               ("y", "mixer", True), ("xo", "block", True))}
        return {**got, "parts": parts, "aux": [None] * L, "output": output, "own": own,
                "step_vs_forward": gap}

    def reference(self, call: Call) -> Reference:
        from transformers import DynamicCache

        ref = super().reference(call)
        if ref.extra["own"] is not None:  # the whole-sequence scan's, from the same forward
            finals = [o.pop("final")[:, None] for o in ref.extra["own"]]
        else:
            cache = DynamicCache(config=self.module.config)
            with torch.no_grad():  # the whole-sequence scan, its final state left in the cache
                self.module(inputs_embeds=call.inputs, cache_params=cache, use_cache=True)
            finals = [cache.get_recurrent_state(k).reshape(call.batch, 1, -1)
                      for k in range(self.num_layers)]  # (B, 1, d_inner·N) each
        ref.final = torch.cat(finals, dim=-1)[:, 0]
        diffs = [scaled_diff(f, ref.extra["parts"][k][1][:, -1:]) for k, f in enumerate(finals)]
        ref.extra["final_vs_step"] = worst_of(diffs)
        return ref

    # the blocks' RMSNorms in the hand cell's dtype (the package rounds them to float32)
    def pre(self, k, m, x):
        norm = m.layers[k].norm
        return rms(x, norm.variance_epsilon, norm.weight)

    def final(self, m, x):
        return rms(x, m.norm_f.variance_epsilon, m.norm_f.weight)
