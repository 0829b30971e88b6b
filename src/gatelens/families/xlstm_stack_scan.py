"""xlstm's block stacks (families/xlstm_slstm.py, xlstm_mlstm.py, xlstm_mixed.py) read from
their own whole-sequence forward, as families/xlstm_scan.py reads transformers' xLSTM block.

The stack runs its forward once, with hooks on each block and its layer (the trajectory's
x, u, y, xo) and, in an mLSTM layer, on its convolution's input and its q, k, v and gate
projections. Then, block by block:

- an **mLSTM** block's memory is the package's own step function (``mLSTMCell.backend_fn_step``,
  which ``mLSTMLayer.step`` calls) replayed along the window on the q, k, v, ĩ, f̃ the
  forward formed, from the zero state its step path starts in, every state kept; the
  parallel form (``parallel_stabilized_simple``) normalises as the step does in exact
  arithmetic (max(|qᵀ n̄|, 1) on the raw scale) and places its ε elsewhere, so the
  forward's h against the replay's is ``step_vs_forward``;
- an **sLSTM** block's vanilla forward is itself a loop over the tokens that keeps its
  states inside (``sLSTMCell._impl``): that loop runs again on the gates' projections the
  forward handed the cell, every state kept (its forward's own computation: no second
  path to compare, so ``step_vs_forward`` is the mLSTM blocks' alone).

Every layer's input and output and the stack's output are the forward's own; an mLSTM
block is traced with the signals the package computed (``read_own``), an sLSTM block by the
hand cell on its own state at t − 1. The step path of the whole stack (``_trajectory``) stays the
independent per-token reference the tests hold these states against.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from gatelens.families.buffers import state_empty
from gatelens.families.records import Recorder, conv_buffer, scaled_diff, worst_of
from gatelens.families.xlstm_scan import raw_memory, scan_kind, scanned

__all__ = ["XLSTMStackForward"]

MLSTM = "mLSTMLayer"


def _kind(block: nn.Module) -> str:
    return type(block.xlstm).__name__  # "sLSTMLayer" or "mLSTMLayer"


class XLSTMStackForward:
    """``scan_modules`` and ``trajectory_recorded`` of an xlstm block stack, on its
    ``module`` (the xLSTMBlockStack) and ``num_layers`` (an sLSTM block gives no "own":
    ``OfficialFamily.read_own`` reads it by the hand cell)."""

    def scan_modules(self) -> dict[str, nn.Module]:
        """Each block and its layer; an mLSTM layer's convolution (xlstm builds none
        without one), projections and gates."""
        mods: dict[str, nn.Module] = {}
        for k, block in enumerate(self.module.blocks):
            layer = block.xlstm
            mods.update({f"block{k}": block, f"mixer{k}": layer})
            if _kind(block) != MLSTM:
                mods[f"scell{k}"] = layer.slstm_cell  # its input: the gates' projections
            else:
                cell = layer.mlstm_cell
                mods.update({f"conv{k}": layer.conv1d, f"q{k}": layer.q_proj,
                             f"k{k}": layer.k_proj, f"v{k}": layer.v_proj,
                             f"ig{k}": cell.igate, f"fg{k}": cell.fgate, f"cell{k}": cell})
        return mods

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        seq = rec.blocks(self.num_layers)
        mlstm = self._mlstm_states(rec)
        parts, aux, gaps, own = [], [], [], []
        for k, block in enumerate(self.module.blocks):
            if k in mlstm:
                p, m, gap, mine = mlstm[k]
                gaps.append(gap)
            else:  # its cell's own loop: no second path to compare; its gates stay inside
                p, m = self._slstm_states(k, block.xlstm, rec, seq["u"][k])
                mine = None
            parts.append(p)
            aux.append(m)
            own.append(mine)
        worst = worst_of(gaps) if gaps else None
        return {**seq, "parts": parts, "aux": aux, "output": output, "step_vs_forward": worst,
                "own": own}

    @torch.no_grad()
    def _mlstm_states(self, rec: Recorder) -> dict[int, tuple]:
        """Each mLSTM block k's parts (its convolution buffer, C̄ = e^m C, n̄ = e^m n) and
        its m after every step, (B, T, ·) float64, by the package's step function on what
        the forward formed; the forward's h against the replay's; and the signals as the
        package computed them (``read_own``'s: the stabilised i = e^{ĩ − m'}, f = σ(f̃), h).
        Blocks that share one step function are replayed together, one call a token."""
        groups: dict = {}
        for k, block in enumerate(self.module.blocks):
            if _kind(block) == MLSTM:
                groups.setdefault(block.xlstm.mlstm_cell.backend_fn_step, []).append(k)
        out = {}
        for step, ks in groups.items():
            got = [rec.stacked(f"{n}{k}", outputs=True) for k in ks
                   for n in ("q", "k", "v", "ig", "fg")]
            q, key, v, i, f = (torch.cat(got[j::5]) for j in range(5))  # blocks on the batch
            NH = int(self.module.blocks[ks[0]].xlstm.mlstm_cell.config.num_heads)
            h, C, N, M = _replay(step, NH, q, key, v, i, f)
            B = q.shape[0] // len(ks)
            for j, k in enumerate(ks):
                at = slice(j * B, (j + 1) * B)
                out[k] = self._mlstm_block(k, rec, h[at], C[at], N[at], M[at], i[at], f[at])
        return out

    def _mlstm_block(self, k: int, rec: Recorder, h: Tensor, C: Tensor, N: Tensor, M: Tensor,
                     i: Tensor, f: Tensor) -> tuple:
        """``_mlstm_states``'s figures of block k from its replayed h, C, n, m."""
        layer = self.module.blocks[k].xlstm
        B, T = M.shape[:2]
        # the raw scale e^m, as _step_state reads it, in float64
        raw = raw_memory(C, N, torch.exp(M.double()), torch.float64)
        parts = [conv_buffer(rec.stacked(f"conv{k}"), int(layer.config.conv1d_kernel_size))
                 .double(), *raw]
        own_h = layer.mlstm_cell.outnorm(h).transpose(1, 2).reshape(B, T, -1)
        mine = {"i": torch.exp(i - M), "f": torch.sigmoid(f), "h": own_h}
        mine["kappa"] = mine["f"]  # a mixed stack's keep letter
        return (parts, M.double(), scaled_diff(own_h, rec.stacked(f"cell{k}", outputs=True)),
                mine)

    @torch.no_grad()
    def _slstm_states(self, k: int, layer: nn.Module, rec: Recorder, u: Tensor
                      ) -> tuple[list[Tensor], Tensor]:
        """Block k's parts (its convolution buffer, h, s = c/n, ℓ = m + ln n) and its m after
        every step, (B, T, ·) float64: its vanilla cell's own loop (``_impl``, what its
        forward runs) on the gates' projections the forward handed it, every state kept,
        read as ``_step_state`` reads its step path's."""
        cell = layer.slstm_cell
        x = cell._permute_input(rec.stacked(f"scell{k}"))
        states = cell._impl(False, x, cell._get_state(x, None))  # (4, T + 1, B, H)
        h, c, n, m = (v.transpose(0, 1) for v in states[:, 1:])  # (B, T, H) each
        K = int(layer.config.conv1d_kernel_size)
        buf = [conv_buffer(u, K).double()] if K > 0 else []
        return buf + [h.double(), (c / n).double(), (m + torch.log(n)).double()], m.double()

@torch.no_grad()
def _replay(step: Callable, NH: int, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """xlstm's mLSTM step function ``step`` along the window from the zero state its step
    path starts in, every state kept: q, k, v (B, T, NH·d) and ĩ, f̃ (B, T, NH) as the layer
    formed them. Returns h̃ (B, NH, T, d) and the stabilised C (B, T, NH, d, d), n (B, T,
    NH, d) and m (B, T, NH) after every step."""
    B, T, D = q.shape
    d = D // NH
    q, k, v = (x.reshape(B, T, NH, d).transpose(1, 2) for x in (q, k, v))  # (B, NH, T, d)
    i, f = (g.transpose(1, 2)[..., None] for g in (i, f))  # (B, NH, T, 1)
    if scan_kind(step, q.dtype) == "simple":  # its operations, as a scan
        return scanned("simple", q, k, v, i, f, inspect.signature(step).parameters["eps"].default)
    c, n, m = q.new_zeros(B, NH, d, d), q.new_zeros(B, NH, d, 1), q.new_zeros(B, NH, 1, 1)
    C, N, M = state_empty((B, T, NH, d, d), c.dtype, c.device), n.new_empty(B, T, NH, d), \
        m.new_empty(B, T, NH)
    h = q.new_empty(B, NH, T, d)
    for t in range(T):
        at = slice(t, t + 1)
        h[:, :, at], (c, n, m) = step(c_state=c, n_state=n, m_state=m, q=q[:, :, at],
                                      k=k[:, :, at], v=v[:, :, at], igate_preact=i[:, :, at],
                                      fgate_preact=f[:, :, at])
        C[:, t], N[:, t], M[:, t] = c, n[..., 0], m[..., 0, 0]
    return h, C, N, M
