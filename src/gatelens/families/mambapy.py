"""mambapy's ``Mamba`` (1.2.0; the stack inside its ``MambaLM``): the selective-scan cell
of families/hf_mamba.py on mambapy's weights.

Block k: x ← x + MambaBlock(RMSNorm(x)); no final norm (``MambaLM`` adds its own and the
head). Its mixer's forward bypasses ``dt_proj`` as a module (it multiplies by the weight),
so the cell is recomputed from the weights, with its optional ``inner_layernorms`` on Δ, B,
C applied by the mixer's own ``_apply_layernorms``. Its mixer class is named
``MambaBlock`` like transformers' block, so families test classes by module path. The
states come from one whole-sequence forward: hooks on the projections, and the step path's
arithmetic (``mambapy_replay``: ``ssm_step`` along the window) on what they returned; the
forward's own scan (pscan or its sequential loop) against it is ``step_vs_forward``. With
``use_cuda`` (its fused scan) the step path itself is read (``ResidualBlock.step``:
``mixer.step`` on the norm, the cache (s, the convolution's inputs) passed along), layer by
layer so each layer's input and output are kept. mambapy 1.2.0's ``mambapy.lm`` (its
``MambaLM``) imports ``mamba_ssm``, a CUDA-only package, at import time, so on the CPU the
stack is used inside a model of one's own; the family never imports ``mambapy.lm``.

>>> import torch
>>> from mambapy.mamba import Mamba, MambaConfig
>>> fam = MambapyFamily(Mamba(MambaConfig(d_model=8, n_layers=2, d_state=4, d_conv=3)))
>>> call = fam.check(torch.randn(2, 6, 8))
>>> max(d.max_scaled_diff_h for d in fam.one_step(call, fam.reference(call))) < 1e-5
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.families.base import Call
from gatelens.families.forward_scan import linear_scan
from gatelens.families.hf_mamba import MambaCell
from gatelens.families.official import Recorder, conv_buffer, scaled_diff
from gatelens.families.recipe import Recipe
from gatelens.families.records import worst_of


def _build(n_in: int, hidden: int, layers: int, *, settings: dict, **_: object) -> nn.Module:
    from mambapy.mamba import Mamba, MambaConfig

    return Mamba(MambaConfig(d_model=hidden, n_layers=layers, **settings))


#: ``--cell mambapy``: state 16, expand 2, conv 4, between an embedding and a head
MAMBAPY_RECIPE = Recipe(
    "mambapy", "mambapy's Mamba (Mamba-1 in pure PyTorch)", _build, reads="embedded",
    flags=frozenset(), package=("mambapy", "mambapy"),
    settings={"d_state": 16, "d_conv": 4, "expand_factor": 2}, keep_words="Mamba exp(Δ·A)")


class MambapyFamily(MambaCell):
    """mambapy's ``Mamba`` stack (``mambapy.mamba.Mamba``; ``MambaLM.mamba``)."""

    name = "mambapy"
    opens_what = "mambapy's Mamba (the stack inside MambaLM)"
    recipe = MAMBAPY_RECIPE

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == "mambapy.mamba" and type(module).__name__ == "Mamba"

    def mixers(self, m: nn.Module) -> list[nn.Module]:
        return [layer.mixer for layer in m.layers]

    def _bcdt(self, mixer, dt, B, C):
        return mixer._apply_layernorms(dt, B, C)

    def _forward(self, call: Call) -> Tensor:
        return self.module(call.inputs)

    def own_output(self, call: Call) -> Tensor:
        """What the module returns for the call (an edited run reads its prefix)."""
        return self._forward(call)

    def _trajectory(self, call: Call) -> dict:
        L, Bsz = self.num_layers, call.batch
        cfg = self.module.config
        caches = [(None, call.inputs.new_zeros(Bsz, cfg.d_inner, cfg.d_conv - 1))
                  for _ in range(L)]
        rec: dict[str, list[list[Tensor]]] = {n: [[] for _ in range(L)]
                                              for n in ("x", "u", "y", "xo", "buf", "s")}
        outs = []
        for t in range(call.length):
            x = call.inputs[:, t]  # (B, D)
            for k, layer in enumerate(self.module.layers):  # Mamba.step, each layer kept
                u = layer.norm(x)
                y, caches[k] = layer.mixer.step(u, caches[k])
                s, buf = caches[k]  # (B, Din, N), (B, Din, d_conv − 1)
                for n, v in (("x", x), ("u", u), ("y", y), ("xo", y + x),
                             ("buf", buf.transpose(1, 2).reshape(Bsz, -1)),
                             ("s", s.reshape(Bsz, -1))):
                    rec[n][k].append(v.clone())
                x = y + x  # ResidualBlock.step: output + x
            outs.append(x)
        seq = {n: [torch.stack(v, dim=1) for v in per] for n, per in rec.items()}  # (B, T, ·)
        return {"x": seq["x"], "u": seq["u"], "y": seq["y"], "xo": seq["xo"],
                "parts": [[seq["buf"][k], seq["s"][k]] for k in range(L)],
                "aux": [None] * L, "output": torch.stack(outs, dim=1)}

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each layer, its mixer, in_proj, x_proj and out_proj, whose calls in one
        whole-sequence forward give every state (``mambapy_replay``); None with
        ``use_cuda`` (the fused CUDA scan)."""
        if self.module.config.use_cuda:
            return None
        mods: dict[str, nn.Module] = {}
        for k, layer in enumerate(self.module.layers):
            mods.update({f"{n}{k}": mod for n, mod in (
                ("layer", layer), ("mixer", layer.mixer), ("in", layer.mixer.in_proj),
                ("xp", layer.mixer.x_proj), ("out", layer.mixer.out_proj))})
        return mods

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        """The step path's arithmetic (``mambapy_replay``) on what each layer's projections
        returned; the forward's own scan (pscan, or its sequential loop) against it is
        ``step_vs_forward``."""
        L = self.num_layers
        parts, own, gap = [], [], (0.0, 0.0)
        for k, mix in enumerate(self.mixers(self.module)):
            x, z = rec.stacked(f"in{k}", outputs=True).chunk(2, dim=-1)  # (B, T, ED) each
            sig, s, y = mambapy_replay(mix, rec.stacked(f"xp{k}"),
                                       rec.stacked(f"xp{k}", outputs=True), z)
            d = scaled_diff(y, rec.stacked(f"out{k}"))
            gap = worst_of([gap, d])
            parts.append([conv_buffer(x, self.d_conv), s])
            own.append(sig)
        got = {n: [rec.stacked(f"{m}{k}", outputs=o) for k in range(L)]
               for n, m, o in (("x", "layer", False), ("u", "mixer", False),
                               ("y", "mixer", True), ("xo", "layer", True))}
        return {**got, "parts": parts, "aux": [None] * L, "output": output, "own": own,
                "step_vs_forward": gap}

    def pre(self, k, m, x):
        return m.layers[k].norm(x)

    def post(self, k, m, x, y):
        return x + y


@torch.no_grad()
def mambapy_replay(mix: nn.Module, xh: Tensor, xproj: Tensor, z: Tensor
                   ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """mambapy's ``MambaBlock.ssm_step`` (its decode step) along a whole window, from what the
    forward's x_proj received (x̂ (B, T, ED), the activated convolution) and returned
    (``xproj``), with its own operations: its inner norms, Δ = softplus(dt_proj(δ)) (the
    step calls dt_proj as a module, where the forward multiplies by its weight), then
    h = exp(Δ A) h + (Δ B) x̂ (forward_scan.linear_scan, time-major), y = h C + D x̂.
    Returns Δ (B, T, ED) and the keep a (B, T, ED·N), h (B, T, ED·N), and y ⊙ silu(z), the
    figure the forward's own output before out_proj is compared with."""
    N, rank = mix.A_log.shape[1], mix.dt_proj.weight.shape[1]
    delta, B, C = torch.split(xproj.transpose(0, 1), [rank, N, N], dim=-1)  # (T, B, ·)
    delta, B, C = mix._apply_layernorms(delta, B, C)
    delta = F.softplus(mix.dt_proj(delta))  # (T, B, ED)
    A = -torch.exp(mix.A_log.float())  # (ED, N)
    x = xh.transpose(0, 1)
    a = torch.exp(delta.unsqueeze(-1) * A)  # (T, B, ED, N)
    s = linear_scan(a, (delta.unsqueeze(-1) * B.unsqueeze(2)) * x.unsqueeze(-1))
    y = (s @ C.unsqueeze(-1)).squeeze(-1) + mix.D.float() * x  # (T, B, ED)
    sig = {"delta": delta.transpose(0, 1), "a": a.transpose(0, 1).flatten(2)}
    return sig, s.transpose(0, 1).flatten(2), (y * F.silu(z.transpose(0, 1))).transpose(0, 1)
