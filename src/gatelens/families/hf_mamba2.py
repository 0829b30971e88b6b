"""transformers' Mamba-2 (``Mamba2Model``, inside ``Mamba2ForCausalLM``; 5.23).

The mixer: g, xBC, δ = in_proj(u) (split intermediate, conv_dim, heads); xBC ← act(causal
depthwise conv(xBC)), split into x (heads × head_dim), B and C (groups × state); per head h
(group h // (heads / groups)):
  Δ_h = softplus(δ_h + dt_bias_h),  a_h = exp(Δ_h A_h),  A = −exp(A_log)  (one per head);
  s_t[h] = a_h s_{t−1}[h] + Δ_h x_t[h] ⊗ B_t[g]   (head_dim × state);
  y = out_proj(GatedRMSNorm((s_t[h] C_t[g] + D_h x_t[h]), gate g)).
One decay per head for all head_dim × state entries of its state: the units are the heads.
The module's own trajectory: the model run one token at a time with its cache (its
recurrent ``mamba2_selective_state_update``, which takes no ``time_step_limit`` clamp, so
the family takes none), against the chunked whole-sequence scan (``step_vs_forward``).
The input enters s through the convolution's window of d_conv positions.

>>> import torch
>>> from transformers import Mamba2Config, Mamba2Model
>>> cfg = Mamba2Config(vocab_size=7, hidden_size=8, state_size=4, num_heads=2, head_dim=8,
...                    expand=2, n_groups=1, conv_kernel=3, num_hidden_layers=1, chunk_size=4)
>>> fam = HFMamba2Family(Mamba2Model(cfg))
>>> call = fam.check(torch.randint(0, 7, (2, 6)))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.families.buffers import state_empty, zeros64
from gatelens.families.forward_scan import linear_scan
from gatelens.families.hf_mamba import HFMambaFamily, hf_forward, hf_model
from gatelens.families.official import Recorder, buffer_units, conv_buffer, scaled_diff
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, CellSpec

MAMBA2 = CellSpec(
    name="mamba2", kind="mamba2", chunks=("delta", "B", "C"),
    signals=("delta", "a", "s", "y"), gates=("a",), keep_gate="a", input_gate=None,
    state="s", output="y", bounds={"a": SIGMOID},
    display={"a": "keep exp(Δ·A) per head", "delta": "step Δ per head"})
_SETTINGS = {"state_size": 16, "expand": 2, "head_dim": 16, "n_groups": 1, "conv_kernel": 4,
             "chunk_size": 64}


def _build_mamba2(n_in: int, hidden: int, layers: int, *, vocab_size: int, settings: dict,
                  **_: object) -> nn.Module:
    heads = settings["expand"] * hidden // settings["head_dim"]
    return hf_model("Mamba2Model", "Mamba2Config", vocab_size=vocab_size, hidden_size=hidden,
                    num_heads=heads, num_hidden_layers=layers, **settings)


#: ``--cell hf-mamba2``: state 16, expand 2, head_dim 16, 1 group; --hidden a multiple of
#: head_dim / expand, so the heads fill the inner width
MAMBA2_RECIPE = Recipe(
    "hf-mamba2", "transformers' Mamba2Model (Mamba-2; it embeds the ids itself)",
    _build_mamba2, reads="ids", flags=frozenset(), package=("transformers", "transformers"),
    settings=_SETTINGS, multiple=lambda heads: _SETTINGS["head_dim"] // _SETTINGS["expand"],
    keep_words="Mamba-2 exp(Δ·A) a head", forward=hf_forward)

_HF = "transformers.models.mamba2.modeling_mamba2"


class HFMamba2Family(HFMambaFamily):
    """transformers' ``Mamba2Model`` (``Mamba2ForCausalLM.backbone``)."""

    name = "hf-mamba2"
    opens_what = "transformers' Mamba2Model / Mamba2ForCausalLM (Mamba-2)"
    cell_name = "mamba2"
    specs = (MAMBA2,)
    recipe = MAMBA2_RECIPE
    units_name = "head"

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == _HF and type(module).__name__ == "Mamba2Model"

    @property
    def heads(self) -> int:
        return int(self._mixer.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self._mixer.head_dim)

    @property
    def d_state(self) -> int:
        return int(self._mixer.ssm_state_size)

    @property
    def conv_dim(self) -> int:
        return int(self._mixer.conv_dim)

    @property
    def hidden_size(self) -> int:
        return self.heads

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.heads).repeat_interleave(self.head_dim * self.d_state)

    def part_units(self, k: int) -> list[Tensor]:
        return [buffer_units(self.d_conv, self.conv_dim), self.state_units(k)]

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        S = self.heads * self.head_dim * self.d_state
        return zeros64(self.module, batch, (self.d_conv - 1) * self.conv_dim, S)

    def step_cell(self, k, m, u, parts, aux, edit=None):
        mix = self.mixers(m)[k]
        return mamba2_step(mix, mix.in_proj(u), parts, edit)

    def scan_layer(self, k, m, u):
        mix = self.mixers(m)[k]
        return mamba2_scan(mix, mix.in_proj(u))

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each block, its mixer and the mixer's in_proj and gated norm (transformers'
        ``Mamba2Mixer`` only), whose calls in one whole-sequence forward give every state."""
        from transformers.models.mamba2 import modeling_mamba2 as hf

        if any(type(mix) is not hf.Mamba2Mixer for mix in self.mixers(self.module)):
            return None
        mods: dict[str, nn.Module] = {}
        for k, block in enumerate(self.module.layers):
            mods.update({f"block{k}": block, f"mixer{k}": block.mixer,
                         f"in{k}": block.mixer.in_proj, f"norm{k}": block.mixer.norm})
        return mods

    def scan_steps(self) -> None:
        """None: the chunked scan holds no per-token state to keep (``layer_recorded``)."""
        return None

    def layer_recorded(self, rec: Recorder, k: int) -> tuple[list[Tensor], dict, tuple]:
        """Layer k of ``trajectory_recorded`` (HFMambaFamily's, built from this): the
        package's own convolution on what in_proj returned and its decode step's recurrence
        replayed on it (mamba2_replay): its parts, its own signals, and the chunked scan's
        output against the replay's (abs, scaled). The chunked scan of the forward holds no
        per-token state."""
        from transformers.models.mamba2 import modeling_mamba2 as hf

        mix = self.mixers(self.module)[k]
        zxbcdt = rec.stacked(f"in{k}", outputs=True)  # (B, T, inner + conv_dim + heads)
        _, xbc, _ = zxbcdt.split([mix.intermediate_size, mix.conv_dim, mix.num_heads], -1)
        xc = hf.causal_conv1d_fn(xbc.transpose(1, 2), mix.conv1d.weight.squeeze(1),
                                 mix.conv1d.bias, activation=mix.activation).transpose(1, 2)
        sig, s, y = mamba2_replay(mix, zxbcdt, xc)
        gap = scaled_diff(y, rec.stacked(f"norm{k}"))  # the chunked scan against the replay
        return [conv_buffer(xbc, self.d_conv), s], sig, gap


def mamba2_step(mix: nn.Module, zxbcdt: Tensor, parts: list[Tensor], edit=None,
                gated=None) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
    """One step of a transformers Mamba-2 mixer (``Mamba2Mixer`` and the hybrids' copies of
    it, families/hf_mamba2_mixers.py), batched over R rows: ``zxbcdt`` is in_proj's output
    (R, inner + conv_dim + heads), ``parts`` the conv buffer and s; ``gated(y, gate)`` is
    what comes between the scan and out_proj (default: the mixer's own ``norm(y, gate)``);
    ``edit(letter, v)`` an intervention's edit inside the step. (signals, parts', y)."""
    edit = edit or (lambda letter, v: v)
    NH, P, N, G = int(mix.num_heads), int(mix.head_dim), int(mix.ssm_state_size), mix.n_groups
    K, inner, cd = mix.conv1d.weight.shape[-1], mix.intermediate_size, mix.conv_dim
    buf, s = parts
    gate, xbc, dt = zxbcdt.split([inner, cd, NH], dim=-1)
    window = torch.cat([buf.view(-1, K - 1, cd), xbc[:, None]], dim=1)  # (R, K, conv_dim)
    xc = (window * mix.conv1d.weight[:, 0].T).sum(dim=1)
    if mix.conv1d.bias is not None:
        xc = xc + mix.conv1d.bias
    xc = mix.act(xc)
    x, B, C = torch.split(xc, [inner, G * N, G * N], dim=-1)
    delta = edit("delta", F.softplus(dt + mix.dt_bias))  # (R, NH)
    A = -torch.exp(mix.A_log.float()).to(zxbcdt.dtype)  # (NH,), in float32 as HF takes it
    a = edit("a", torch.exp(delta * A))  # (R, NH): the head's keep
    rep = NH // G
    Bh = B.view(-1, G, N).repeat_interleave(rep, dim=1)  # (R, NH, N)
    Ch = C.view(-1, G, N).repeat_interleave(rep, dim=1)
    xh = x.view(-1, NH, P)
    s_new = a[..., None, None] * s.view(-1, NH, P, N) + (
        delta[..., None, None] * xh[..., None] * Bh[:, :, None, :])  # (R, NH, P, N)
    s_new = edit("s", s_new.reshape(-1, NH * P * N)).view(-1, NH, P, N)
    y = ((s_new @ Ch[..., None])[..., 0] + mix.D[:, None] * xh).reshape(-1, inner)  # (R, inner)
    y = mix.out_proj(gated(y, gate) if gated is not None else mix.norm(y, gate))
    new = [window[:, 1:].reshape(-1, (K - 1) * cd), s_new.reshape(-1, NH * P * N)]
    return {"delta": delta, "a": a}, new, y


def _heads(mix: nn.Module, xc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (·, ·, NH, P), B and C (·, ·, NH, N), a group's B and C for each of its heads, from
    the convolution's activated output (·, ·, conv_dim): (B, T) or (T, B) first."""
    NH, P, N, G = int(mix.num_heads), int(mix.head_dim), int(mix.ssm_state_size), mix.n_groups
    Bn, T = xc.shape[:2]
    x, B, C = torch.split(xc, [mix.intermediate_size, G * N, G * N], dim=-1)
    rep = NH // G
    return (x.reshape(Bn, T, NH, P), B.reshape(Bn, T, G, N).repeat_interleave(rep, dim=2),
            C.reshape(Bn, T, G, N).repeat_interleave(rep, dim=2))


@torch.no_grad()
def mamba2_replay(mix: nn.Module, zxbcdt: Tensor, xc: Tensor
                  ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """The package's decode step (``mamba2_selective_state_update``) replayed along a whole
    window, in its own operations and order: Δ = softplus(δ + dt_bias), a = exp(Δ A),
    s = s ⊙ a + (Δ B) x (bit for bit, tested), then y = s C + D x over the whole window (a
    check figure, to float32 rounding of the step's). ``zxbcdt``: in_proj's output, ``xc``:
    the convolution's activated output, as the forward computed them, (B, T, ·). Returns
    ({"delta", "a"} (B, T, NH) each), s (B, T, NH·P·N) and y before the gated norm
    (B, T, inner). Each step's input term (Δ_t B_t) x_t is formed where it is added (in one
    (heads, head_dim, state) buffer that stays in cache), and every s_t written once,
    straight into the (B, T, ·) layout the trace holds (``state_empty``)."""
    NH = int(mix.num_heads)
    Bn, T = zxbcdt.shape[:2]
    dt = zxbcdt[..., -NH:].transpose(0, 1)  # (T, B, NH)
    x, B, C = _heads(mix, xc.transpose(0, 1))  # (T, B, NH, ·)
    delta = F.softplus(dt + mix.dt_bias.to(dt.dtype))
    a = torch.exp(delta.float() * (-torch.exp(mix.A_log.float())))[..., None, None]
    s = state_empty((Bn, T, NH, x.shape[-1], B.shape[-1]), x.dtype, x.device)  # (B,T,NH,P,N)
    prev = torch.zeros_like(s[:, 0])  # the first step multiplies the zero state too
    work = torch.empty_like(prev)
    dB, xs = delta[..., None, None] * B[:, :, :, None, :], x[..., None]  # (T, B, NH, ·, ·)
    for t in range(T):
        st = s[:, t]
        torch.mul(a[t], prev, out=st).add_(torch.mul(dB[t], xs[t], out=work))
        prev = st
    # y = s C + D x (a check figure): as C's row times sᵀ, a product of one row that runs
    # ~3x faster on the CPU than s times C's column (a batch of matrix-vector products)
    y = (C.transpose(0, 1)[..., None, :] @ s.to(C.dtype).transpose(-1, -2))[..., 0, :] + \
        x.transpose(0, 1) * mix.D[:, None]  # (B, T, NH, P)
    return ({"delta": delta.transpose(0, 1), "a": a[..., 0, 0].transpose(0, 1)},
            s.flatten(2), y.reshape(Bn, T, -1))


def mamba2_scan(mix: nn.Module, zxbcdt: Tensor, gated=None
                ) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
    """``mamba2_step`` over a whole window from the zero state (B, T, ·): every step's input
    side at once (the convolution over each step's window; it reads no state), then the
    recurrence along time, time-major (the states made once, in the layout it walks).
    (signals, parts, y) as ``OfficialFamily.scan_layer`` returns them, (B, T, ·) each."""
    K, inner, cd = mix.conv1d.weight.shape[-1], mix.intermediate_size, mix.conv_dim
    NH = int(mix.num_heads)
    Bn, T = zxbcdt.shape[:2]
    gate, xbc, dt = zxbcdt.transpose(0, 1).split([inner, cd, NH], dim=-1)  # (T, B, ·) each
    pad = torch.cat([xbc.new_zeros(K - 1, Bn, cd), xbc], dim=0)  # (T + K − 1, B, cd)
    window = pad.unfold(0, K, 1).permute(0, 3, 1, 2)  # (T, K, B, cd)
    xc = (window * mix.conv1d.weight[:, 0].T[:, None]).sum(dim=1)  # (T, B, cd)
    if mix.conv1d.bias is not None:
        xc = xc + mix.conv1d.bias
    x, B, C = _heads(mix, mix.act(xc))  # (T, B, NH, ·)
    delta = F.softplus(dt + mix.dt_bias)  # (T, B, NH)
    A = -torch.exp(mix.A_log.float()).to(zxbcdt.dtype)
    a = torch.exp(delta * A)
    b = delta[..., None, None] * x[..., None] * B[:, :, :, None, :]  # (T, B, NH, P, N)
    s = linear_scan(a[..., None, None], b, overwrite=True)  # b is not read again
    y = ((s @ C[..., None])[..., 0] + mix.D[:, None] * x).reshape(T, Bn, inner)
    y = mix.out_proj(gated(y, gate) if gated is not None else mix.norm(y, gate))
    parts = [conv_buffer(xbc.transpose(0, 1), K), s.transpose(0, 1).flatten(2)]
    return ({"delta": delta.transpose(0, 1), "a": a.transpose(0, 1)}, parts,
            y.transpose(0, 1))
