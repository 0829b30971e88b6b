"""mambapy's ``Mamba`` (1.2.0; the stack inside its ``MambaLM``): the selective-scan cell
of families/hf_mamba.py on mambapy's weights.

Block k: x ← x + MambaBlock(RMSNorm(x)); no final norm (``MambaLM`` adds its own and the
head). Its mixer's forward bypasses ``dt_proj`` as a module (it multiplies by the weight),
so the cell is recomputed from the weights, with its optional ``inner_layernorms`` on Δ, B,
C applied by the mixer's own ``_apply_layernorms``. Its mixer class is named
``MambaBlock`` like transformers' block, so families test classes by module path. The
module's own trajectory: its ``step`` path (``ResidualBlock.step``: ``mixer.step`` on the
norm, with the cache (s, the convolution's inputs) passed along), run here layer by layer so
each layer's input and output are kept; the whole-sequence forward (pscan or its sequential
scan) is compared with it (``step_vs_forward``). mambapy 1.2.0's ``mambapy.lm`` (its
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
from torch import Tensor, nn

from gatelens.families.base import Call
from gatelens.families.hf_mamba import MambaCell
from gatelens.families.recipe import Recipe


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

    def pre(self, k, m, x):
        return m.layers[k].norm(x)

    def post(self, k, m, x, y):
        return x + y
