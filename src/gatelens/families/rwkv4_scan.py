"""RWKV-4's per-token states read from ONE whole-sequence forward of transformers' RwkvModel.

The package's CPU path (``RwkvSelfAttention.forward`` → ``rwkv_linear_attention_cpu``)
forms key, value and receptance for the whole window with its ``nn.Linear`` modules (which
a hook can record), then loops over t for the max-shifted state (num, den, max), of which
it returns only the last (and only with ``use_cache``). ``wkv_replay`` is that loop as the
package writes it (the same operations in the same order, on the same (B, C) rows from the
same key and value tensors), so every state it hands back is the one the forward's loop
held, bit for bit, and its output is the forward's ``wkv``: the model's own returned state
and the attention output's input r ⊙ wkv check it (tests/test_rwkv4_scan.py).

``RwkvForward`` is the family's side of it (mixed into ``HFRwkvFamily``): the modules to
record, the trajectory from what they recorded, and the one-step check's extra row (the
read-out wkv against the replay's: the states never read time_first, so a replay whose
bonus is off shows only there).

``wkv_scan`` is the same recurrence in its dynamic form (num, den on one scale, no max
shift: the family's float64 hand cell) over a whole window at once, for the free-running
re-run layer by layer (``HFRwkvFamily.scan_layer``).

>>> import torch
>>> k, v = torch.zeros(1, 3, 2), torch.ones(1, 3, 2)  # (B, T, C)
>>> wkv, num, den, p = wkv_replay(torch.zeros(2), torch.zeros(2), k, v)
>>> wkv[0, :, 0].tolist()  # a mean of equal values: v itself
[1.0, 1.0, 1.0]
>>> [round(n, 4) for n in (num * p.exp())[0, :, 0].tolist()]  # 1, 1 + e^{−1}, 1 + e^{−1} + e^{−2}
[1.0, 1.3679, 1.5032]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.families.base import LayerDiff, Reference
from gatelens.families.forward_scan import linear_scan
from gatelens.families.records import Recorder, nan_max, scaled_diff, worst_of

__all__ = ["RwkvForward", "token_shift", "wkv_replay", "wkv_scan"]

_HF = "transformers.models.rwkv.modeling_rwkv"


class RwkvForward:
    """``scan_modules``, ``trajectory_recorded`` and ``judge`` of the hf-rwkv family, on its
    ``module`` (the RwkvModel), ``num_layers`` and ``post``."""

    def _output_of(self, returned: Any) -> Tensor:
        if isinstance(returned, (tuple, list)):  # return_dict=False
            return returned[0]
        return returned.last_hidden_state

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each block, its attention and feed-forward (their first argument: ln1's and
        ln2's output, the token shifts' states) and the attention's key, value, receptance
        and output Linear, whose calls in one whole-sequence forward give every state
        (``trajectory_recorded``). None (the decode path) unless every attention runs
        transformers' own CPU loop: its class ``RwkvSelfAttention``, no forward put in its
        place, and not the CUDA kernel (loaded, the weights on a GPU)."""
        hf = sys.modules.get(_HF)
        mods: dict[str, nn.Module] = {}
        for k, blk in enumerate(self.module.blocks):
            att = blk.attention
            if type(att).__module__ != _HF or type(att).__name__ != "RwkvSelfAttention" \
                    or "forward" in vars(att) or hf is None or (
                        hf.rwkv_cuda_kernel is not None and att.time_decay.is_cuda):
                return None
            mods.update({f"block{k}": blk, f"att{k}": att, f"ffn{k}": blk.feed_forward,
                         f"key{k}": att.key, f"value{k}": att.value,
                         f"rec{k}": att.receptance, f"out{k}": att.output})
        return mods

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        """The package's wkv loop replayed on what each attention's key and value Linear
        returned (rwkv4_scan.wkv_replay: every state its loop held), r ⊙ wkv against what
        the attention's output Linear received (``step_vs_forward``)."""
        L, parts, own, gap = self.num_layers, [], [], (0.0, 0.0)
        for k, blk in enumerate(self.module.blocks):
            att = blk.attention
            key = rec.stacked(f"key{k}", outputs=True)
            value = rec.stacked(f"value{k}", outputs=True)
            r = torch.sigmoid(rec.stacked(f"rec{k}", outputs=True))  # as the module forms it
            wkv, num, den, p = wkv_replay(att.time_decay, att.time_first, key, value)
            d = scaled_diff(r * wkv, rec.stacked(f"out{k}"))
            gap = worst_of([gap, d])
            scale = torch.exp(p.double())  # back from the max shift, as ``_trajectory``
            parts.append([rec.stacked(f"att{k}").double(), num.double() * scale,
                          den.double() * scale, rec.stacked(f"ffn{k}").double()])
            keep = torch.exp(-torch.exp(att.time_decay)).expand_as(key)  # e^{−w}
            own.append({"r": r, "k": key, "v": value, "keep": keep, "wkv": wkv})
        x = [rec.stacked(f"block{k}") for k in range(L)]
        y = [rec.stacked(f"block{k}", outputs=True) for k in range(L)]
        return {"x": x, "u": x, "y": y,
                "xo": [self.post(k, self.module, x[k], y[k]) for k in range(L)],
                "parts": parts, "aux": [None] * L, "output": output, "own": own,
                "step_vs_forward": gap}

    def _row(self, k: int, signals: dict[str, Tensor], ref: Reference,
             link: tuple[float, float] = (0.0, 0.0)) -> LayerDiff:
        """s and y (the base's), and where the states were read from the forward, the
        read-out wkv against the replay's: the states never read time_first, so a replay
        whose bonus is off shows only in wkv."""
        row, own = super()._row(k, signals, ref, link), ref.extra.get("own")
        if own is None or "wkv" not in signals:
            return row
        a, s = scaled_diff(signals["wkv"], own[k]["wkv"])
        return LayerDiff(k, False, nan_max(row.max_abs_diff_h, a), None,
                         max_scaled_diff_h=nan_max(row.max_scaled_diff_h, s))


@torch.no_grad()
def wkv_replay(time_decay: Tensor, time_first: Tensor, key: Tensor, value: Tensor
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``rwkv_linear_attention_cpu(time_decay, time_first, key, value)`` from the zero state
    on what the layer's key and value Linear returned, (B, T, C) each, every state kept:
    (wkv (B, T, C) in key's dtype, and the package's num, den, max after every token,
    (B, T, C) float32 each; the carried pair is (num, den)·e^{max})."""
    B, T, C = key.shape
    output = torch.zeros_like(key)
    num_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
    den_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
    max_state = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
    nums, dens, maxs = (torch.empty(B, T, C, dtype=torch.float32, device=key.device)
                        for _ in range(3))
    time_decay = -torch.exp(time_decay)
    for t in range(T):  # the package's loop, statement for statement
        current_key = key[:, t].float()
        current_value = value[:, t]
        max_for_output = torch.maximum(max_state, current_key + time_first)
        e1 = torch.exp(max_state - max_for_output)
        e2 = torch.exp(current_key + time_first - max_for_output)
        numerator = e1 * num_state + e2 * current_value
        denominator = e1 * den_state + e2
        output[:, t] = (numerator / denominator).to(output.dtype)
        max_for_state = torch.maximum(max_state + time_decay, current_key)
        e1 = torch.exp(max_state + time_decay - max_for_state)
        e2 = torch.exp(current_key - max_for_state)
        num_state = e1 * num_state + e2 * current_value
        den_state = e1 * den_state + e2
        max_state = max_for_state
        nums[:, t], dens[:, t], maxs[:, t] = num_state, den_state, max_state
    return output, nums, dens, maxs


def token_shift(x: Tensor) -> Tensor:
    """x_{t−1} along dim 1, zeros before the first token: (B, T, C) -> (B, T, C)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def wkv_scan(keep: Tensor, bonus: Tensor, key: Tensor, value: Tensor
             ) -> tuple[Tensor, Tensor, Tensor]:
    """The hand cell's recurrence over whole windows (B, T, C) from the zero state:
    num_t = keep ⊙ num_{t−1} + e^{k_t} v_t, den_t = keep ⊙ den_{t−1} + e^{k_t}, and the read-out
    wkv_t = (num_{t−1} + bonus_t v_t) / (den_{t−1} + bonus_t), bonus = e^{u + k}: the same
    expressions as ``HFRwkvFamily.step_cell``, a step's products in its order. Returns
    (wkv, num, den), each (B, T, C)."""
    ek = torch.exp(key)
    a = keep.expand_as(key).transpose(0, 1)  # time leads: linear_scan walks dim 0
    num = linear_scan(a, (ek * value).transpose(0, 1)).transpose(0, 1)
    den = linear_scan(a, ek.transpose(0, 1)).transpose(0, 1)
    wkv = (token_shift(num) + bonus * value) / (token_shift(den) + bonus)
    return wkv, num, den
