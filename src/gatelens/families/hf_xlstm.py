"""transformers' xLSTM (5.23; xLSTM-7B's architecture): each ``xLSTMBlock`` of an
``xLSTMModel`` / ``xLSTMForCausalLM`` opened on its own, where it sits
(``backbone.blocks.K``). Where the ``xlstm`` package is installed, transformers builds the
block from xlstm's ``xlstm_large`` mLSTMBlock and NX-AI's ``mlstm_kernels`` backend, else from
its own copy of them; both compute the same block, and both are opened.

One block (METHODS "xlstm mLSTM", here without the causal conv and the skip of xlstm's
mLSTMLayer), with u = RMSNorm(x) and per head (NH heads, d_qk and d_v wide):
  q, k, v, õ = W u (``q``/``k``/``v``/``ogate_preact``, or the fused ``qkv_opreact``);
  ĩ, f̃ = cap · tanh(W_{i,f} u / cap)  (the gates' soft cap, ``gate_soft_cap``, 15);
  the package's step (``mlstm_recurrent_step__native``), with q̄ = q / √d_qk:
    m' = max(ln σ(f̃) + m, ĩ),  C' = e^{ln σ(f̃) + m − m'} C + e^{ĩ − m'} k vᵀ  (d_qk × d_v),
    n' = (same f) n + (same i) k,  h̃ = q̄ᵀ C' / (max(|q̄ᵀ n'|, e^{−m'}) + ε);
  h = LayerNorm per head(h̃) · w;  y = out_proj(σ(õ) ⊙ h);  the block: r = x + y,
  out = r + FFN(RMSNorm r)  (FFN = down(silu(gate u') ⊙ up u')).
The carried state is the memory in the raw scale, C̄ = e^{m} C and n̄ = e^{m} n, which no
stabiliser touches: C̄' = σ(f̃) C̄ + e^{ĩ} k vᵀ, n̄' = σ(f̃) n̄ + e^{ĩ} k, and
h̃ = q̄ᵀ C̄' / (max(|q̄ᵀ n̄'|, 1) + ε e^{m'}). The keep factor is the head's raw σ(f̃), one per
head for its d_qk·d_v + d_qk entries (units: the heads); m (in [−cap, cap], so e^{m} stays
finite) enters only through ε and is taken from the module's own trajectory (``aux``), as
in families/xlstm_mlstm.py. The trace holds per layer: i = e^{ĩ − m'} and f = σ(f̃) per head,
o = σ(õ) per channel of v, m (the package's stabiliser after the step) per head, s = C̄ per
head (d_qk × d_v, row by row, head by head) then n̄ per head, h, and y the mLSTM layer's
output (before the residual).

The states come from the block's own whole-sequence forward (families/xlstm_scan.py: hooks
on its projections, and the backend's own step kernel replayed on the q, k, v, ĩ, f̃ they
gave), against its prompt path (the chunkwise kernel, the prompt padded to ``chunk_size``
with f̃ = 25, ĩ = −25: ``step_vs_forward`` on h) and the final state that path returns
(``final_vs_step``, in the raw scale, where the two paths' stabilisers do not enter). Where
the layer or its backend runs another forward, the decode path is read: the block run one
token at a time with the state the model's ``xLSTMCache`` holds (zeros of its shapes and
dtype, copied into after every step as ``xLSTMModel`` does). The memory is judged on its
head's scale (``head_scaled_diff``), y per channel. The decode path exists in
``mode="inference"`` (the config's default) only; on the CPU it needs the native kernels
(``chunkwise--native_autograd``, ``native_sequence__native``, ``native``, the config's
defaults; xLSTM-7B's checkpoint names Triton ones).

>>> import torch
>>> from transformers import xLSTMConfig, xLSTMForCausalLM
>>> cfg = xLSTMConfig(vocab_size=7, hidden_size=64, num_hidden_layers=1, num_heads=4,
...                   chunk_size=16, ffn_round_up_to_multiple_of=16)
>>> model = xLSTMForCausalLM(cfg)
>>> fam = HFXLSTMFamily(model.backbone.blocks[0])
>>> call = fam.check(torch.randn(2, 6, 64))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gatelens.cells.names import layer_name
from gatelens.errors import GatelensError
from gatelens.families.base import Call, LayerDiff, Reference
from gatelens.families.buffers import joined, zeros64
from gatelens.families.delta_edit import StepEdits, no_edit
from gatelens.families.official import OfficialFamily, Recorder, scaled_diff
from gatelens.families.records import largest_abs, worst_of
from gatelens.families.spec import SIGMOID, CellSpec
from gatelens.families.xlstm_mlstm import XLSTM_MLSTM
from gatelens.families.xlstm_scan import XLSTMForward

_HF = "transformers.models.xlstm.modeling_xlstm"
#: the backend kernels that run on the CPU (xLSTMConfig's defaults)
NATIVE_KERNELS = {"chunkwise_kernel": "chunkwise--native_autograd",
                  "sequence_kernel": "native_sequence__native", "step_kernel": "native"}

#: xLSTM-7B's mLSTM cell: xlstm's mLSTM letters (families/xlstm_mlstm.py) with the output
#: gate o and the stabiliser m beside them; y, the layer's output, is what perturbations read
HF_XLSTM = CellSpec(
    name="hf_xlstm", kind=XLSTM_MLSTM.kind, chunks=XLSTM_MLSTM.chunks,
    signals=("i", "f", "o", "m", "s", "h", "y"), gates=("i", "f", "o"),
    keep_gate=XLSTM_MLSTM.keep_gate, input_gate=XLSTM_MLSTM.input_gate, state="s",
    output="y", bounds={**XLSTM_MLSTM.bounds, "o": SIGMOID},
    display={**XLSTM_MLSTM.display, "o": "output gate σ(õ) per channel",
             "m": "stabiliser m per head (the package's)"})


def soft_cap(x: Tensor, cap: float | None) -> Tensor:
    """The package's gate soft cap, cap · tanh(x / cap) (None: no cap)."""
    return x if cap is None else cap * torch.tanh(x / cap)


def _affine(norm: nn.Module, x: Tensor) -> Tensor:
    if norm.weight is not None:
        x = x * norm.weight
    if norm.bias is not None:
        x = x + norm.bias
    return x


def rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """The package's RMSNorm, x / √(mean x² + ε) · w (+ b), in x's dtype (the package
    reduces in float32; the hand cell stays in float64)."""
    return _affine(norm, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))


def head_norm(norm: nn.Module, h: Tensor) -> Tensor:
    """The package's multi-head LayerNorm: each head's (N, NH, d_v) normalised over d_v,
    then joined (N, NH·d_v) and scaled by w (+ b)."""
    mu = h.mean(-1, keepdim=True)
    var = h.var(-1, keepdim=True, unbiased=False)
    return _affine(norm, ((h - mu) * torch.rsqrt(var + norm.eps)).flatten(1))


def head_scaled_diff(got: Tensor, ref: Tensor, units: Tensor,
                     over: Tensor | None = None) -> tuple[float, float]:
    """(max |got − ref|, the same over its unit's largest |ref| in the window, over all of
    the unit's coordinates, at least 1): the memory judged on its head's scale. A head's
    C̄ entries are sums of e^{ĩ} k_i v_j whose float32 projections (d-long dot products)
    round relative to the terms, not to an entry that happens to be small: judged entry by
    entry (``scaled_diff``) they miss by 1e-5 at xLSTM-7B's width, on the head's scale by
    1e-6. ``got``, ``ref`` (B, T, S); ``units`` (S,) the unit of each coordinate; ``over``
    (B, T', S) the window the scale is taken over (default ``ref``).

    >>> ref = torch.tensor([[[100.0, 0.01]]], dtype=torch.float64)
    >>> got = ref + torch.tensor([0.0, 1e-4], dtype=torch.float64)
    >>> [round(d, 8) for d in head_scaled_diff(got, ref, torch.tensor([0, 0]))]
    [0.0001, 1e-06]
    >>> round(scaled_diff(got, ref)[1], 8)  # entry by entry: 1e-4 over max(1, 0.01)
    0.0001
    """
    diff = (got.double() - ref.double()).abs()
    # |·| and max are exact in any dtype: reduced first, converted after (the same numbers)
    top = largest_abs(ref if over is None else over).double()  # (B, S)
    idx = units.to(top.device).expand_as(top)
    per_unit = top.new_zeros(top.shape[0], int(units.max()) + 1).scatter_reduce(
        1, idx, top, reduce="amax")
    scale = per_unit.gather(1, idx).clamp(min=1.0)[:, None]  # (B, 1, S)
    return float(diff.max()), float((diff / scale).max())


class HFXLSTMFamily(XLSTMForward, StepEdits, OfficialFamily):
    """One ``xLSTMBlock`` (its mLSTM layer, norms and feed-forward) of transformers' xLSTM."""

    name = "hf-xlstm"
    opens_what = ("transformers' xLSTM blocks (xLSTM-7B's mLSTM; each xLSTMBlock inside "
                  "xLSTMModel / xLSTMForCausalLM)")
    cell_name = HF_XLSTM.name
    specs = (HF_XLSTM,)
    units_name = "head"
    uses_aux = True  # the stabiliser m (only through ε), from the trajectory
    #: an edited run carries the stabiliser itself (families/official_edit.py)
    live_aux = "stabiliser"
    #: the stabiliser is the package's bookkeeping: no edit of it
    derived = ("m",)

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        t = type(module)
        return (t.__module__, t.__name__) == (_HF, "xLSTMBlock")

    @classmethod
    def hf_config_overrides(cls, raw: dict) -> tuple[dict, str] | None:
        """For a local checkpoint (loaders/hf_dir.py): an xLSTM config.json naming kernels
        other than the native ones (xLSTM-7B's name Triton kernels, which need CUDA) is
        opened with the native ones, the same computation, and a note saying so."""
        if raw.get("model_type") != "xlstm":
            return None
        changed = {k: v for k, v in NATIVE_KERNELS.items() if raw.get(k, v) != v}
        if not changed:
            return None
        was = ", ".join(f"{k} {raw[k]!r}" for k in changed)
        return changed, (f"xLSTM's kernels replaced by the native ones that run on the CPU "
                         f"(config.json had {was}): the same recurrence")

    # ---- facts ---------------------------------------------------------------------
    @property
    def _layer(self) -> nn.Module:
        return self.module.mlstm_layer

    @property
    def shape(self) -> tuple[int, int, int]:
        """(heads, d_qk, d_v), as the layer's projections split them."""
        layer = self._layer
        NH = int(layer.config.num_heads)
        return NH, int(layer.qk_dim) // NH, int(layer.v_dim) // NH

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def hidden_size(self) -> int:
        return self.shape[0]

    @property
    def _backend(self):
        return self._layer.mlstm_backend.config

    def describe(self) -> dict:
        NH, dqk, dv = self.shape
        cfg = self._backend
        kernels = {k: str(getattr(cfg, k)) for k in ("chunkwise_kernel", "sequence_kernel",
                                                     "step_kernel") if hasattr(cfg, k)}
        return {**super().describe(), "heads": NH, "qk_head_dim": dqk, "v_head_dim": dv,
                "gate_soft_cap": self._layer.config.gate_soft_cap,
                "weight_mode": str(self._layer.config.weight_mode), "mode": str(cfg.mode),
                **kernels, "block": "mLSTM block (each opened on its own)"}

    def state_units(self, k: int) -> Tensor:
        NH, dqk, dv = self.shape
        heads = torch.arange(NH)
        return torch.cat([heads.repeat_interleave(dqk * dv), heads.repeat_interleave(dqk)])

    def part_units(self, k: int) -> list[Tensor]:
        u, cc = self.state_units(k), self.shape[0] * self.shape[1] * self.shape[2]
        return [u[:cc], u[cc:]]

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        NH, dqk, dv = self.shape
        return zeros64(self.module, batch, NH * dqk * dv, NH * dqk)

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return joined(parts)  # (N, NH·(d_qk·d_v + d_qk)): C̄ then n̄

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict):
        """(x, state); a state of zeros (what xLSTMModel hands each block from the fresh
        cache it makes with ``use_cache``) is the zero state, None."""
        inputs = args[0] if args else kwargs.get("x")
        state = args[1] if len(args) > 1 else kwargs.get("state")
        if isinstance(state, (tuple, list)) and all(
                isinstance(s, Tensor) and not bool(s.any()) for s in state):
            state = None
        return inputs, state

    def check(self, inputs, state=None) -> Call:
        if state is not None:
            raise GatelensError(
                f"{self.name}: a state (C, n, m) other than zeros passed to xLSTMBlock (a "
                "cache after earlier tokens) is not supported; the analysis runs whole "
                "windows from the zero state")
        mode = str(self._backend.mode)
        if mode != "inference":
            raise GatelensError(
                f"{self.name}: the block's mLSTM backend runs mode={mode!r}; its decode path "
                "(the reference of every state) exists in mode='inference' only "
                "(xLSTMConfig(mode='inference'), the default)")
        return OfficialFamily.check(self, inputs)

    # ---- the module's own computation ------------------------------------------------
    def _forward(self, call: Call) -> Tensor:
        return self.own_output(call)[0]

    def own_output(self, call: Call) -> Any:
        """What the block returns for the call from the zero state: (output, state)."""
        return self.module(call.inputs, None)

    def _zeros(self, batch: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The state xLSTMCache holds before the first token, of the block's shapes."""
        NH, dqk, dv = self.shape
        return (like.new_zeros(batch, NH, dqk, dv), like.new_zeros(batch, NH, dqk),
                like.new_zeros(batch, NH, 1))

    @staticmethod
    def _raw(state) -> tuple[Tensor, Tensor, Tensor]:
        """(C̄, n̄, m) of a package state (C, n, m), (B, 1, ·) each, in float64 (copies: the
        cache's buffers change in place at the next step)."""
        C, n, m = (s.double().clone() for s in state)
        B = C.shape[0]
        scale = torch.exp(m)  # (B, NH, 1)
        return ((C * scale[..., None]).reshape(B, 1, -1), (n * scale).reshape(B, 1, -1),
                m.reshape(B, 1, -1))

    def _trajectory(self, call: Call) -> dict:
        x, B = call.inputs, call.batch
        state = self._zeros(B, x)
        outs, carried = [], []
        with Recorder({"layer": self._layer}) as rec:
            for t in range(call.length):
                out, new = self.module(x[:, t : t + 1], state)
                for buf, value in zip(state, new, strict=True):
                    buf.copy_(value)  # the cache, as xLSTMModel updates it
                outs.append(out)
                carried.append(self._raw(state))
        C, n, m = (torch.cat(z, dim=1) for z in zip(*carried, strict=True))
        output = torch.cat(outs, dim=1)
        return {"x": [x], "u": [rec.stacked("layer")], "y": [rec.stacked("layer", outputs=True)],
                "xo": [output], "parts": [[C, n]], "aux": [m], "output": output}

    def reference(self, call: Call) -> Reference:
        ref = super().reference(call)
        if ref.extra["own"] is not None:  # the prompt path's final state, same forward
            final = ref.extra["own"][0].pop("final")[:, None]
        else:
            with torch.no_grad():  # the prompt path's final state (what the cache keeps)
                _, last = self.module(call.inputs, self._zeros(call.batch, call.inputs))
            C, n, _ = self._raw(last)
            final = torch.cat([C, n], dim=-1)  # (B, 1, S)
        ref.final = final[:, 0]
        steps = ref.states["layer0.s"]  # the step path's, (B, T, S)
        ref.extra["final_vs_step"] = head_scaled_diff(final, steps[:, -1:], self.state_units(0),
                                                      over=steps)
        return ref

    def _row(self, k: int, signals: dict[str, Tensor], ref: Reference,
             link: tuple[float, float] = (0.0, 0.0)) -> LayerDiff:
        """The memory s on each head's scale (``head_scaled_diff``), y (the layer's output,
        per channel) as every official family judges it."""
        ds = head_scaled_diff(signals["s"], ref.states[f"{layer_name(k)}.s"],
                              self.state_units(k))
        dy = scaled_diff(signals["y"], ref.states[f"{layer_name(k)}.y"])
        worst = worst_of([ds, dy, link])
        return LayerDiff(k, False, worst[0], None, max_scaled_diff_h=worst[1])

    # ---- the hand cell ---------------------------------------------------------------
    def _project(self, layer: nn.Module, u: Tensor):
        """(q, k, v, õ, ĩ, f̃) of the layer on u (N, d), the gates soft-capped."""
        cap = layer.config.gate_soft_cap
        if hasattr(layer, "qkv_opreact"):  # weight_mode "fused"
            qk, dv = int(layer.qk_dim), int(layer.v_dim)
            q, k, v, o = torch.split(layer.qkv_opreact(u), [qk, qk, dv, dv], dim=-1)
            i, f = soft_cap(layer.ifgate_preact(u), cap).chunk(2, dim=-1)
            return q, k, v, o, i, f
        return (layer.q(u), layer.k(u), layer.v(u), layer.ogate_preact(u),
                soft_cap(layer.igate_preact(u), cap), soft_cap(layer.fgate_preact(u), cap))

    def initial_stabiliser(self, k: int, batch: int) -> Tensor:
        """The package's m before the first token (the cache's zeros)."""
        return torch.zeros(batch, self.shape[0], dtype=torch.float64)

    def step_cell(self, k, m, u, parts, aux, edit=no_edit, prev=None):
        """One step; ``prev`` (an edited run): the stabiliser m before the step, from which
        m' is computed as the package does, else ``aux`` is m'."""
        layer = m.mlstm_layer
        NH, dqk, dv = self.shape
        q, key, v, o, pi, pf = self._project(layer, u)
        C, n = parts[0].view(-1, NH, dqk, dv), parts[1].view(-1, NH, dqk)
        q, key, v = q.view(-1, NH, dqk) * dqk ** -0.5, key.view(-1, NH, dqk), v.view(-1, NH, dv)
        f0 = torch.sigmoid(pf)
        f = edit("f", f0)  # (N, NH)
        m_new = aux if prev is None else torch.maximum(
            (torch.nn.functional.logsigmoid(pf) if f is f0 else torch.log(f)) + prev, pi)
        i0 = torch.exp(pi - m_new)
        i = edit("i", i0)  # the stabilised exp(ĩ − m'); an edited i is written as i · e^{m'}
        ei = torch.exp(pi) if i is i0 else i * torch.exp(m_new)
        C_new = f[..., None, None] * C + ei[..., None, None] * (key[..., :, None] * v[..., None, :])
        n_new = f[..., None] * n + ei[..., None] * key
        s_new = edit("s", torch.cat([C_new.reshape(-1, NH * dqk * dv),
                                     n_new.reshape(-1, NH * dqk)], dim=-1))
        C_new = s_new[:, : NH * dqk * dv].view(-1, NH, dqk, dv)
        n_new = s_new[:, NH * dqk * dv:].view(-1, NH, dqk)
        num = torch.einsum("rhi,rhij->rhj", q, C_new)  # (N, NH, d_v): q̄ᵀ C̄
        qn = (q * n_new).sum(-1, keepdim=True).abs()
        eps = float(layer.mlstm_backend.config.eps)
        htil = num / (torch.maximum(qn, torch.ones_like(qn)) + eps * torch.exp(m_new)[..., None])
        h = edit("h", head_norm(layer.multihead_norm, htil))
        gate = edit("o", torch.sigmoid(o))
        y = layer.out_proj(gate * h)
        sig = {"i": i, "f": f, "o": gate, "m": m_new, "h": h}
        return sig, [C_new.reshape(-1, NH * dqk * dv), n_new.reshape(-1, NH * dqk)], y

    def pre(self, k, m, x):
        return rms_norm(m.norm_mlstm, x)

    def post(self, k, m, x, y):
        res = x + y
        return res + m.ffn(rms_norm(m.norm_ffn, res))

