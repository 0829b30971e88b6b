"""RWKV-7's hand cell with an edit inside its step, and the edited run (``Lens.run``
edits, the return path cut, attribution patching) through families/official_edit.py.

One step of block k (families/rwkv7.py gives the equations), on the package's weights ``z``
(float64 for the read-out and the dynamics, the model's own float32 ``z`` for an edited
run), with ``edit(letter, value)`` applied where each trace letter is computed: r; w, the
keep per channel; a, the in-context rate (before it scales the written key); kk, the
removal key; k, the written key; v, the written value (layer 0's is v_first, which every
layer above mixes in: an edited run carries the edited one up, ``live_aux``); s, the state
after the step; y, the block's output, after the block (official_edit).

The keep w per channel lies in (e^{−0.606531}, 1); at a pre-activation of 0 it is

>>> import torch
>>> round(float(torch.exp(-W_SCALE * torch.sigmoid(torch.tensor(0.0)))), 4)
0.7384
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gatelens.families.delta_edit import StepEdits, no_edit
from gatelens.families.rwkv7_train import GN_EPS, W_SCALE

__all__ = ["RWKV7Edits"]


class RWKV7Edits(StepEdits):
    """The RWKV-7 family's hand cell (``step_cell``, edits inside) and what an edited run
    reads: the package's own float32 weights, v_first from the edited run."""

    #: layer 0's v is the v_first every layer above mixes in: an edited run's own
    live_aux = "first_value"

    def edit_weights(self) -> dict[str, Tensor]:
        """The weights an edited run steps on: the model's own ``z``, in its dtype."""
        return self.model.z  # type: ignore[attr-defined]

    def step_cell(self, k: int, m: dict[str, Tensor], u: Tensor, parts: list[Tensor],
                  aux: Tensor | None, edit: Any = no_edit
                  ) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
        """One step of block k on weights ``m`` (the package's ``z``), N rows: (signals,
        parts', y); ``aux`` v_first (k > 0)."""
        z, C, (H, N) = m, self.hidden_size, self.heads  # type: ignore[attr-defined]
        a_ = f"blocks.{k}.att."
        R = u.shape[0]
        x_prev, s, f_prev = parts
        x = F.layer_norm(u, (C,), weight=z[f"blocks.{k}.ln1.weight"],
                         bias=z[f"blocks.{k}.ln1.bias"])
        # the six token-shift mixes in one product (one op each under the dynamics' jvp)
        mixes = x[:, None] + (x_prev - x)[:, None] * torch.stack(
            [z[a_ + "x_" + n] for n in "rwkvag"])  # (R, 6, C)
        mix = dict(zip("rwkvag", mixes.unbind(1), strict=True))
        r = edit("r", mix["r"] @ z[a_ + "receptance.weight"])
        w = torch.tanh(mix["w"] @ z[a_ + "w1"]) @ z[a_ + "w2"]
        key = mix["k"] @ z[a_ + "key.weight"]
        v = mix["v"] @ z[a_ + "value.weight"]
        a = edit("a", torch.sigmoid(z[a_ + "a0"] + (mix["a"] @ z[a_ + "a1"]) @ z[a_ + "a2"]))
        g = torch.sigmoid(mix["g"] @ z[a_ + "g1"]) @ z[a_ + "g2"]
        kk = edit("kk", F.normalize((key * z[a_ + "k_k"]).view(R, H, N), dim=-1,
                                    p=2.0).view(R, C))
        key = edit("k", key * (1 + (a - 1) * z[a_ + "k_a"]))
        if k > 0:
            v = v + (aux - v) * torch.sigmoid(z[a_ + "v0"] + (mix["v"] @ z[a_ + "v1"])
                                              @ z[a_ + "v2"])
        v = edit("v", v)
        w = edit("w", torch.exp(-W_SCALE * torch.sigmoid(z[a_ + "w0"] + w)))
        sig = {"r": r, "w": w, "k": key, "v": v, "a": a, "kk": kk}
        kept = self.spec.keep_operator(sig, s)  # type: ignore[attr-defined]
        S = kept.view(R, H, N, N) + v.view(R, H, N, 1) * key.view(R, H, 1, N)
        S = edit("s", S.reshape(R, -1)).view(R, H, N, N)
        o = (S * r.view(R, H, 1, N)).sum(dim=-1)  # (R, H, N): S r
        o = (o - o.mean(-1, keepdim=True)) / torch.sqrt(o.var(-1, unbiased=False, keepdim=True)
                                                         + GN_EPS)
        o = o.reshape(R, C) * z[a_ + "ln_x.weight"] + z[a_ + "ln_x.bias"]
        o = o + ((r * key * z[a_ + "r_k"]).view(R, H, N).sum(-1, keepdim=True)
                 * v.view(R, H, N)).view(R, C)
        h = u + (o * g) @ z[a_ + "output.weight"]
        f_ = f"blocks.{k}.ffn."
        f = F.layer_norm(h, (C,), weight=z[f"blocks.{k}.ln2.weight"],
                         bias=z[f"blocks.{k}.ln2.bias"])
        fk = torch.relu((f + (f_prev - f) * z[f_ + "x_k"]) @ z[f_ + "key.weight"]) ** 2
        y = h + fk @ z[f_ + "value.weight"]
        return sig, [x, S.reshape(R, -1), f], y

    def own_output(self, call: Any) -> Tensor:
        """What the module returns for the call: the package's forward, window by window."""
        return self._forward(call)  # type: ignore[attr-defined]
