"""transformers' xLSTM block (families/hf_xlstm.py) read from its own whole-sequence forward,
as families/forward_scan.py and delta_scan.py read the other families.

The block's prompt path is the backend's chunkwise kernel, which holds the memory only at
chunk boundaries. The block runs its own forward once, with hooks on its mLSTM layer's
module calls (the q, k, v and gate projections, the backend, the output gate and the head
norm); the gates' soft cap is the file's own ``soft_cap`` on what the projections returned,
and the backend's own step kernel (``step_kernel_fn``: what its decode path calls for a
one-token call, with its state dtype and ε) is replayed along the window on the q, k, v,
ĩ, f̃ the layer formed, every state kept (``mlstm_replay``; for the native kernel its
operations without T calls of it: the stabiliser a step at a time, the memory as a linear
recurrence, ``scanned``). So the states are, bit for bit, what the backend's one-token path
computes on those inputs (tested: the backend module itself called one token at a time),
and within float32 rounding of the decode path itself
(the whole block one token at a time, whose projections run one row at a time). The
prompt path's h against the replay's is ``step_vs_forward``; its final state
``final_vs_step``.

>>> from types import SimpleNamespace
>>> backend = SimpleNamespace(config=SimpleNamespace(inference_state_dtype="float32",
...                                                  eps=1e-6))
>>> from mlstm_kernels.torch.recurrent.native_step import mlstm_recurrent_step__native
>>> backend.step_kernel_fn = mlstm_recurrent_step__native
>>> q = k = torch.ones(1, 1, 2, 3); v = torch.ones(1, 1, 2, 4)  # (B, NH, T, d)
>>> h, C, n, m = mlstm_replay(backend, q, k, v, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
>>> C.shape, m.shape  # (B, T, NH, d_qk, d_v), (B, T, NH)
(torch.Size([1, 2, 1, 3, 4]), torch.Size([1, 2, 1]))
"""

from __future__ import annotations

import inspect
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.families.base import Call
from gatelens.families.buffers import state_empty
from gatelens.families.delta_scan import package_function, torch_path
from gatelens.families.forward_scan import linear_scan
from gatelens.families.official import Recorder, scaled_diff

__all__ = ["STEP_KINDS", "XLSTMForward", "mlstm_replay", "raw_memory", "scan_kind",
           "scanned"]


class XLSTMForward:
    """``scan_modules``, ``trajectory_recorded`` and ``_forward_trajectory`` of the xLSTM
    family, on its ``module`` (the block), ``_layer``, ``shape``, ``_zeros`` and ``_raw``."""

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """The block, its mLSTM layer, the layer's projections, backend, output gate and
        head norm, whose calls in one whole-sequence forward give every state
        (``mlstm_replay``); None where the layer or its backend runs another forward."""
        layer = self._layer
        if not (torch_path(layer, ()) and torch_path(layer.mlstm_backend, ())):
            return None
        names = ("qkv_opreact", "ifgate_preact") if hasattr(layer, "qkv_opreact") else (
            "q", "k", "v", "igate_preact", "fgate_preact")
        return {"block": self.module, "layer": layer, "backend": layer.mlstm_backend,
                "o": layer.ogate_act_fn, "norm": layer.multihead_norm,
                **{n: getattr(layer, n) for n in names}}

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        return self._recorded(rec, output, None)

    def _forward_trajectory(self, call: Call) -> dict | None:
        """``trajectory_recorded`` of the block's prompt path from the zero state, which
        also returns its final state (``own``'s "final", ``final_vs_step``)."""
        mods = self.scan_modules()
        if mods is None:
            return None
        with Recorder(mods) as rec:
            output, last = self.module(call.inputs, self._zeros(call.batch, call.inputs))
        return self._recorded(rec, output, last)

    def _recorded(self, rec: Recorder, output: Tensor, last) -> dict:
        """The backend's own step kernel replayed over the window on the q, k, v, ĩ, f̃ the
        layer formed (``mlstm_replay``); its prompt path's h against the replay's is
        ``step_vs_forward``. ``last``: the prompt path's final state, or None."""
        layer = self._layer
        qkvif = self._gates(layer, rec)
        h, C, n, m = mlstm_replay(layer.mlstm_backend, *qkvif)
        B, T = C.shape[:2]
        # the raw scale C̄ = e^m C, n̄ = e^m n, each formed once in the trace's (B, T, ·)
        # layout: in the module's dtype where e^m stays far inside its range (the gates'
        # soft cap keeps |m| ≤ 15; C̄ is then one rounding from the float64 product), else
        # in float64 (a stabiliser past 60 would leave float32's range with C's own size)
        wide = output.dtype if float(m.abs().amax()) <= RAW_M_MAX else torch.float64
        parts = raw_memory(C, n, torch.exp(m.to(wide)), wide)
        i, f = (g.transpose(1, 2) for g in qkvif[3:])  # (B, T, NH)
        own = {"i": torch.exp(i - m), "f": torch.sigmoid(f), "m": m,
               "o": rec.stacked("o", outputs=True),
               "h": rec.stacked("norm", outputs=True).reshape(B, T, -1)}
        own = {k: v.to(output.dtype) for k, v in own.items()}
        if last is not None:
            own["final"] = torch.cat(self._raw(last)[:2], dim=-1)[:, 0]
        return {"x": [rec.stacked("block")], "u": [rec.stacked("layer")],
                "y": [rec.stacked("layer", outputs=True)], "xo": [output],
                "parts": [parts], "aux": [m.double()], "output": output, "own": [own],
                "step_vs_forward": scaled_diff(h, rec.stacked("backend", outputs=True))}

    def _gates(self, layer: nn.Module, rec: Recorder) -> tuple[Tensor, ...]:
        """q, k (B, NH, T, d_qk), v (B, NH, T, d_v), ĩ and f̃ (B, NH, T) as the layer hands
        them to its backend, from its recorded projections (the file's own ``soft_cap``)."""
        NH, cap = self.shape[0], layer.config.gate_soft_cap
        cap_fn = package_function(layer, "soft_cap")
        if hasattr(layer, "qkv_opreact"):
            qk, dv = int(layer.qk_dim), int(layer.v_dim)
            q, k, v, _ = torch.tensor_split(rec.stacked("qkv_opreact", outputs=True),
                                            (qk, 2 * qk, 2 * qk + dv), dim=-1)
            i, f = torch.tensor_split(cap_fn(rec.stacked("ifgate_preact", outputs=True),
                                             cap_value=cap), (NH,), dim=-1)
        else:
            q, k, v = (rec.stacked(n, outputs=True) for n in ("q", "k", "v"))
            i, f = (cap_fn(rec.stacked(n, outputs=True), cap_value=cap)
                    for n in ("igate_preact", "fgate_preact"))
        B, T = q.shape[:2]
        q, k, v = (x.reshape(B, T, NH, -1).transpose(1, 2) for x in (q, k, v))
        return q, k, v, i.transpose(1, 2), f.transpose(1, 2)


def raw_memory(C: Tensor, n: Tensor, scale: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """The raw-scale memory C̄ = e^m C and normaliser n̄ = e^m n in ``dtype``, (B, T, ·) each,
    written side by side into one buffer (the trace's s is its view, ``buffers.joined``):
    C (B, T, NH, d_qk, d_v), n (B, T, NH, d_qk), ``scale`` e^m (B, T, NH)."""
    B, T = C.shape[:2]
    widths = (C[0, 0].numel(), n[0, 0].numel())
    parts = list(state_empty((B, T, sum(widths)), dtype, C.device).split(widths, dim=-1))
    torch.mul(C.to(dtype), scale[..., None, None], out=parts[0].view(C.shape))
    torch.mul(n.to(dtype), scale[..., None], out=parts[1].view(n.shape))
    return parts


#: the largest |m| (the mLSTM's stabiliser) whose raw-scale states e^m C, e^m n are formed in
#: the module's dtype (e^60 ≈ 1e26, far inside float32's 3e38 with C's own size on top)
RAW_M_MAX = 60.0


@torch.no_grad()
def mlstm_replay(backend: nn.Module, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backend's own step kernel (``step_kernel_fn``, what its decode path calls for a
    one-token call, with its state dtype and ε) along the window from the zero state, every
    state kept: q, k (B, NH, T, d_qk), v (B, NH, T, d_v), ĩ, f̃ (B, NH, T). Returns h
    (B, NH, T, d_v) and the package's stabilised state after every step, C (B, T, NH, d_qk,
    d_v), n (B, T, NH, d_qk), m (B, T, NH), in its state dtype."""
    cfg = backend.config
    dtype = getattr(torch, cfg.inference_state_dtype)
    if q.dtype == dtype and scan_kind(backend.step_kernel_fn, dtype) == "native":
        return scanned("native", q, k, v, i, f, cfg.eps)
    step = partial(backend.step_kernel_fn, dtype_state=dtype, eps=cfg.eps)
    # mlstm_kernels names its arguments q, k, v, i, f, c, n, m; transformers' own copy
    # query, key, value, igate, fgate, cstate, nstate, mstate (in that order)
    names = ("query", "key", "value", "igate", "fgate", "cstate", "nstate", "mstate") if \
        "query" in inspect.signature(backend.step_kernel_fn).parameters else tuple("qkvifcnm")
    B, NH, T, dqk = k.shape
    c = torch.zeros(B, NH, dqk, v.shape[-1], dtype=dtype, device=k.device)
    n, m = c.new_zeros(B, NH, dqk), c.new_zeros(B, NH, 1)
    C, N, M = state_empty((B, T, *c.shape[1:]), c.dtype, c.device), n.new_empty(
        B, T, NH, dqk), m.new_empty(B, T, NH)
    h = v.new_empty(v.shape)
    for t in range(T):
        args = (q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t : t + 1], f[:, :, t : t + 1],
                c, n, m)
        h[:, :, t], (c, n, m) = step(**dict(zip(names, args, strict=True)))
        C[:, t], N[:, t], M[:, t] = c, n, m[..., 0]
    return h, C, N, M


#: the step kernels ``scanned`` follows, operation for operation: mlstm_kernels' native
#: step and transformers' own copy of it ("native"), and the xlstm package's
#: ``recurrent_step_stabilized_simple`` ("simple": k scaled by division before the write)
STEP_KINDS = {"mlstm_recurrent_step__native": "native", "mlstm_recurrent_step_native": "native",
              "recurrent_step_stabilized_simple": "simple"}


def scan_kind(step: object, dtype: torch.dtype) -> str | None:
    """The kind (``STEP_KINDS``) of the step kernel ``step`` that ``scanned`` replays with its
    states in ``dtype``; None for another kernel or a state dtype below float32 (it is then
    called a token at a time)."""
    if dtype not in (torch.float32, torch.float64):
        return None
    return STEP_KINDS.get(getattr(step, "__name__", None))


def scanned(kind: str, q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An mLSTM step kernel of ``kind`` (``STEP_KINDS``; state dtype = q's) along the window
    from the zero state without T calls of it: the stabiliser m and the two gate factors a
    step at a time in the kernel's own operations, on the slices it is handed (ĩ, f̃ with
    time on dim 2: a transcendental's bits depend on the tensor it runs on), then the memory
    C_t = e^f̂ C_{t−1} + e^î k_t v_tᵀ and the normaliser n_t = e^f̂ n_{t−1} + e^î k_t as linear
    recurrences (``linear_scan``: each step's product and sum rounded as the kernel's are),
    time-major. q, k, v (B, NH, T, d). Returns h (B, NH, T, d_v), C (B, T, NH, d_qk, d_v),
    n (B, T, NH, d_qk), m (B, T, NH). The states are the kernel's bit for bit (tested against
    the package called a token at a time); h, a check figure only, is formed for every step
    in one product, so its last bits may differ from the kernel's."""
    B, NH, T, dqk = k.shape
    m = q.new_zeros(i[:, :, :1].shape)
    M, fa, ia = q.new_empty(B, T, NH), q.new_empty(T, B, NH, 1), q.new_empty(T, B, NH, 1)
    for t in range(T):
        ft, it = f[:, :, t : t + 1], i[:, :, t : t + 1]
        f_log = F.logsigmoid(ft)
        m_new = torch.max(f_log + m, it)
        fa[t] = torch.exp(f_log + m - m_new).reshape(B, NH, 1)
        ia[t] = torch.exp(it - m_new).reshape(B, NH, 1)
        m = m_new
        M[:, t] = m.reshape(B, NH)
    kt, vt, qt = (x.permute(2, 0, 1, 3) for x in (k, v, q))  # (T, B, NH, ·)
    if kind == "simple":  # the xlstm package writes k / √d and reads h with q as it is
        kt = kt / math.sqrt(dqk)
    else:  # the native kernels write k and read h with q · d^−½
        qt = qt * (dqk ** (-0.5))
    write = torch.mul(kt[..., :, None], vt[..., None, :], out=state_empty(
        (T, B, NH, dqk, vt.shape[-1]), kt.dtype, kt.device)).mul_(ia[..., None])
    C = linear_scan(fa[..., None], write, overwrite=True)  # (T, B, NH, dqk, dv)
    n = linear_scan(fa, kt * ia)  # (T, B, NH, dqk)
    num = (qt[..., None, :] @ C)[..., 0, :]  # (T, B, NH, dv)
    qn = (qt[..., None, :] @ n[..., None])[..., 0]  # (T, B, NH, 1)
    h = num / (torch.maximum(qn.abs(), torch.exp(-M.transpose(0, 1)[..., None])) + eps)
    return h.permute(1, 2, 0, 3), C.transpose(0, 1), n.transpose(0, 1), M
