"""The hand cell of the delta-rule families (Gated DeltaNet, KDA) in the module's own
weights and dtype (float64 for the one-step check and the dynamics): one step, and the
same step over a whole window (``scan_layer``: the free-running re-run layer by layer).

A family gives the parts that differ between packages: ``_qkv(m, u)``, the convolution's
input, and ``_inputs(m, u, xc)``, a step's input side (the trace's alpha, beta, k, v; the
scaled query and the output gate), neither of which reads the state. The rest is shared:
the causal convolution over a window, the state update S_t = A_t(S_{t−1}) + β_t v_t k_tᵀ
with the family's keep operator A_t (``CellSpec.keep_operator``: ``delta_keep``,
``kda_keep``), and the read-out o = S q through the gated RMSNorm and the output projection.

>>> _act("silu")(torch.zeros(1)).tolist()
[0.0]
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.families.delta_edit import no_edit
from gatelens.families.official import conv_buffer

__all__ = ["DeltaCell"]


def _act(name: str):
    """transformers' activation of that name (transformers imported only when used)."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class DeltaCell:
    """``step_cell`` and ``scan_layer`` of a delta-rule family, on its ``shape``, ``spec``,
    ``layers``, ``_qkv`` and ``_inputs`` (module docstring)."""

    def _convolve(self, m: nn.Module, window: Tensor) -> Tensor:
        """The activated causal convolution over each row's window (R, K, conv_dim): tap j
        on the input K − 1 − j steps back."""
        xc = (window * m.conv1d.weight[:, 0].T).sum(dim=1)
        if m.conv1d.bias is not None:
            xc = xc + m.conv1d.bias
        return _act(m.activation)(xc)

    def _write(self, sig: dict[str, Tensor], s: Tensor) -> Tensor:
        """S_t from S_{t−1} (R, H·d_v·d_k): the keep operator, then + β v kᵀ per head."""
        H = sig["beta"].shape[-1]
        key, v = sig["k"].view(-1, H, self.shape[2]), sig["v"].view(-1, H, self.shape[3])
        kept = self.spec.keep_operator(sig, s).view(-1, H, self.shape[3], self.shape[2])
        return (kept + (sig["beta"][..., None] * v)[..., None] * key[:, :, None, :]).flatten(1)

    def _out(self, m: nn.Module, s: Tensor, q: Tensor, gate: Tensor) -> Tensor:
        """The layer's output from S_t (R, H·d_v·d_k): o = S q, its gated RMSNorm per head,
        the output projection."""
        H, dv = q.shape[1], gate.shape[-1]
        o = (s.view(-1, H, dv, q.shape[-1]) * q[:, :, None, :]).sum(dim=-1)  # (R, H, d_v)
        norm = m.norm if hasattr(m, "norm") else m.o_norm
        o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon)
        o = norm.weight * o * _act(norm.activation)(gate)
        out = m.out_proj if hasattr(m, "out_proj") else m.o_proj
        return out(o.reshape(-1, H * dv))

    def step_cell(self, k, m, u, parts, aux, edit=no_edit):
        """One step of layer k, N rows: (alpha, beta, k, v), [conv buffer, S], y; ``edit``
        an intervention's edit inside the step (the gates, then the state)."""
        K, cd = self.shape[4:]
        buf, s = parts
        m = self.layers(m)[k]
        window = torch.cat([buf.view(-1, K - 1, cd), self._qkv(m, u)[:, None]], dim=1)
        sig = self._inputs(m, u, self._convolve(m, window))  # window: (N, K, conv_dim)
        sig.update({n: edit(n, sig[n]) for n in ("k", "v", "beta", "alpha")})
        s_new = edit("s", self._write(sig, s))
        y = self._out(m, s_new, sig["q"], sig["gate"])
        new = [window[:, 1:].reshape(-1, (K - 1) * cd), s_new]
        return {n: sig[n] for n in ("alpha", "beta", "k", "v")}, new, y

    def scan_layer(self, k: int, m: nn.Module, u: Tensor
                   ) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
        """Layer k's hand cell over a whole window ``u`` (B, T, F) from the zero state, in
        ``m``'s dtype: every step's input side at once (projections, convolution, gates:
        none reads the state), the delta rule along time, the read-out at once. The same
        equations as ``step_cell``; (signals, parts, y), each (B, T, ·)."""
        layer = self.layers(m)[k]
        _, H, dk, dv, K, cd = self.shape
        B, T = u.shape[:2]
        flat = u.reshape(B * T, -1)
        qkv = self._qkv(layer, flat).view(B, T, cd)
        pad = torch.cat([qkv.new_zeros(B, K - 1, cd), qkv], dim=1)  # (B, T + K − 1, cd)
        window = pad.unfold(1, K, 1).transpose(2, 3).reshape(B * T, K, cd)
        sig = self._inputs(layer, flat, self._convolve(layer, window))
        steps = {n: sig[n].view(B, T, -1) for n in ("alpha", "beta", "k", "v")}
        s, states = flat.new_zeros(B, H * dv * dk), []
        for t in range(T):
            s = self._write({n: v[:, t] for n, v in steps.items()}, s)
            states.append(s)
        S = torch.stack(states, dim=1)  # (B, T, H·d_v·d_k)
        y = self._out(layer, S.view(B * T, -1), sig["q"], sig["gate"]).view(B, T, -1)
        return steps, [conv_buffer(qkv, K), S], y
