"""transformers' Mamba (``MambaModel``, inside ``MambaForCausalLM``; 5.23), and the
selective-scan cell it shares with mambapy (families/mambapy.py).

Per channel d and state n (METHODS "Modern families"):
  x, z = in_proj(u);  x̂ = act(conv1d(x))  (causal, depthwise, d_conv taps);
  Δ, B, C from x_proj(x̂);  Δ = softplus(dt_proj.weight Δ + dt_proj.bias);
  s_t[d, n] = exp(Δ_t[d] A[d, n]) s_{t−1}[d, n] + Δ_t[d] B_t[n] x̂_t[d],  A = −exp(A_log);
  y = out_proj((C_t · s_t[d, :] + D[d] x̂_t[d]) ⊙ silu(z)).
The units are the (d, n) pairs, the keep a = exp(Δ·A). The mixer never calls ``dt_proj`` or
``conv1d`` as modules (hooks on them never fire), so everything is recomputed from the
weights. The module's own trajectory: the model run one token at a time with its own cache
(its recurrent path, ``selective_state_update``), every state after every step; the
whole-sequence forward (the CPU reference scan) is compared with it (``step_vs_forward``).
The carried state of the dynamics is, per layer, the convolution's last d_conv − 1 inputs
(no unit) and s; the input enters s through a window of d_conv positions.

>>> import torch
>>> from transformers import MambaConfig, MambaModel
>>> cfg = MambaConfig(vocab_size=7, hidden_size=8, state_size=4, num_hidden_layers=1,
...                   expand=2, conv_kernel=3, time_step_rank=2)
>>> fam = HFMambaFamily(MambaModel(cfg))
>>> call = fam.check(torch.randint(0, 7, (2, 6)))
>>> fam.one_step(call, fam.reference(call))[0].max_scaled_diff_h < 1e-5
True
"""

from __future__ import annotations

import abc
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call, Dynamics, Reference
from gatelens.families.buffers import zeros64
from gatelens.families.forward_scan import SequentialScanStates, linear_scan
from gatelens.families.mamba_sweep import sweep
from gatelens.families.official import (
    OfficialFamily,
    Recorder,
    buffer_units,
    conv_buffer,
    scaled_diff,
)
from gatelens.families.recipe import Recipe
from gatelens.families.records import worst_of
from gatelens.families.spec import SIGMOID, CellSpec
from gatelens.families.upcast import float64_memo

_HF = "transformers.models.mamba.modeling_mamba"

#: Mamba's cell (hf-mamba, mambapy): y is the layer's output; the keep exp(Δ·A) scales
#: each (channel, state) pair of s
MAMBA = CellSpec(
    name="mamba", kind="mamba", chunks=("delta", "B", "C"),
    signals=("delta", "a", "s", "y"), gates=("a",), keep_gate="a", input_gate=None,
    state="s", output="y", bounds={"a": SIGMOID},
    display={"a": "keep exp(Δ·A) per (channel, state)", "delta": "step Δ"})


def hf_model(model: str, config: str, **kwargs: object) -> nn.Module:
    """transformers' ``model`` class built from its ``config`` class with ``kwargs``
    (random weights), its notes on the missing fast CUDA kernels silenced."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    return getattr(transformers, model)(getattr(transformers, config)(use_cache=False,
                                                                      **kwargs))


def hf_forward(module: nn.Module, ids: Tensor) -> Tensor:
    """An HF backbone's hidden states (B, T, d) of token ids (B, T)."""
    return module(input_ids=ids, use_cache=False).last_hidden_state


def _build_mamba(n_in: int, hidden: int, layers: int, *, vocab_size: int, settings: dict,
                 **_: object) -> nn.Module:
    return hf_model("MambaModel", "MambaConfig", vocab_size=vocab_size, hidden_size=hidden,
                    num_hidden_layers=layers, **settings)


#: ``--cell hf-mamba``: state 16, expand 2, conv 4; use_mambapy is transformers' own CPU
#: training path, mambapy's parallel scan (its default sequential loop backpropagates
#: through 128 slices of one (B, d, T, N) tensor, each writing a zero copy of it: 178x the
#: LSTM's step, BENCHMARKS.md)
MAMBA_RECIPE = Recipe(
    "hf-mamba", "transformers' MambaModel (Mamba-1; it embeds the ids itself)", _build_mamba,
    reads="ids", flags=frozenset(), package=("transformers", "transformers"),
    settings={"state_size": 16, "expand": 2, "conv_kernel": 4, "use_mambapy": True},
    keep_words="Mamba exp(Δ·A)", forward=hf_forward)


def hf_check(fam: OfficialFamily, inputs, state) -> Call:
    """An HF model's call: token ids (B, T) through its embeddings, or inputs_embeds."""
    if state is not None:
        raise GatelensError(f"{fam.name}: a cache/state passed in is not supported; the "
                            "analysis runs from zeros")
    if isinstance(inputs, Tensor) and inputs.ndim == 2 and not inputs.is_floating_point():
        with torch.no_grad():
            emb = fam.module.get_input_embeddings()(inputs)  # (B, T, D)
        return Call(inputs=emb, layout={"batch_first": True, "ids": inputs})
    return OfficialFamily.check(fam, inputs)


def hf_split(args: tuple, kwargs: dict, state_key: str):
    """(input_ids or inputs_embeds, the cache/state) of an HF model's forward call."""
    inputs = args[0] if args else kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    return inputs, kwargs.get(state_key)


class MambaCell(OfficialFamily):
    """The selective-scan cell on a mixer with in_proj, conv1d, x_proj, dt_proj, A_log, D,
    out_proj; subclasses say where the mixers are and how the module steps."""

    cell_name = "mamba"
    specs = (MAMBA,)
    units_name = "(channel, state) pair"
    #: the float64 copy widens in_proj and out_proj at each call (upcast.py): ~10 % slower over
    #: the many rows a hand cell reads a call, and 0.67 GiB less at 24 Mamba-2 layers
    float64_memo = staticmethod(float64_memo)

    @abc.abstractmethod
    def mixers(self, m: nn.Module) -> list[nn.Module]:
        """The model's mixers, bottom to top (where each implementation keeps them)."""

    @property
    def _mixer(self) -> nn.Module:
        return self.mixers(self.module)[0]

    @property
    def num_layers(self) -> int:
        return len(self.mixers(self.module))

    @property
    def d_inner(self) -> int:
        return int(self._mixer.A_log.shape[0])

    @property
    def d_state(self) -> int:
        return int(self._mixer.A_log.shape[1])

    @property
    def d_conv(self) -> int:
        return int(self._mixer.conv1d.weight.shape[-1])

    @property
    def hidden_size(self) -> int:
        return self.d_inner * self.d_state

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.hidden_size)

    def part_units(self, k: int) -> list[Tensor]:
        return [buffer_units(self.d_conv, self.d_inner), self.state_units(k)]

    def input_window(self) -> int:
        return self.d_conv

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        return zeros64(self.module, batch, (self.d_conv - 1) * self.d_inner, self.hidden_size)

    def _act(self, mixer: nn.Module, x: Tensor) -> Tensor:
        return F.silu(x)

    def _bcdt(self, mixer: nn.Module, dt: Tensor, B: Tensor, C: Tensor):
        return dt, B, C

    def _selective(self, mix: nn.Module, window: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The input side of a step, R rows: the convolution over ``window`` (R, K, Din: the
        last K inputs x, this step's last), activated (x̂), and Δ, B, C from it."""
        N = self.d_state
        w = mix.conv1d.weight[:, 0].T  # (K, Din), tap j on x_{t−K+1+j}
        xc = (window * w).sum(dim=1)
        if mix.conv1d.bias is not None:
            xc = xc + mix.conv1d.bias
        xc = self._act(mix, xc)  # (R, Din)
        rank = mix.dt_proj.weight.shape[1]
        dt, B, C = torch.split(mix.x_proj(xc), [rank, N, N], dim=-1)
        dt, B, C = self._bcdt(mix, dt, B, C)
        return xc, F.softplus(dt @ mix.dt_proj.weight.T + mix.dt_proj.bias), B, C

    def step_cell(self, k, m, u, parts, aux, edit=None):
        edit = edit or (lambda letter, v: v)  # an intervention's edit inside the step
        mix = self.mixers(m)[k]
        Din, N, K = self.d_inner, self.d_state, self.d_conv
        buf, s = parts
        x, z = mix.in_proj(u).chunk(2, dim=-1)  # (R, Din) each
        window = torch.cat([buf.view(-1, K - 1, Din), x[:, None]], dim=1)  # (R, K, Din)
        xc, delta, B, C = self._selective(mix, window)
        delta = edit("delta", delta)
        A = -torch.exp(mix.A_log.float()).to(u.dtype)  # (Din, N): both packages take it in float32
        a = edit("a", torch.exp(delta[..., None] * A).reshape(-1, Din * N)).view(-1, Din, N)
        s_new = a * s.view(-1, Din, N) + delta[..., None] * B[:, None, :] * xc[..., None]
        s_new = edit("s", s_new.reshape(-1, Din * N)).view(-1, Din, N)
        y = self.readout(mix, s_new, C, xc, z)
        new = [window[:, 1:].reshape(-1, (K - 1) * Din), s_new.reshape(-1, Din * N)]
        return {"delta": delta, "a": a.reshape(-1, Din * N)}, new, y

    def readout(self, mix: nn.Module, s: Tensor, C: Tensor, xc: Tensor, z: Tensor) -> Tensor:
        """out_proj((C·s + D x̂) ⊙ silu(z)): the mixer's output from its states s (R, Din, N)."""
        return mix.out_proj(((s @ C[..., None])[..., 0] + mix.D * xc) * F.silu(z))

    def scan_layer(self, k: int, m: nn.Module, u: Tensor
                   ) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
        """Layer k's hand cell over a whole sequence ``u`` (B, T, F) from the zero state, in
        ``m``'s dtype: every step's input side at once (it reads no state), then the
        recurrence s_t = a_t ⊙ s_{t−1} + Δ_t B_t x̂_t along time (forward_scan.linear_scan).
        The same equations as ``step_cell``; (signals, parts, y), each (B, T, ·). Its rows are
        time-major from the start, the layout the recurrence walks, so no (B·T, Din, N) tensor
        (25 MB a window in float64 at mamba-130m's width) is copied: it returns views."""
        mix = self.mixers(m)[k]
        Din, N, K = self.d_inner, self.d_state, self.d_conv
        Bn, T = u.shape[:2]
        x, z = mix.in_proj(u).transpose(0, 1).chunk(2, dim=-1)  # (T, B, Din) each
        pad = torch.cat([x.new_zeros(K - 1, Bn, Din), x], dim=0)  # (T + K − 1, B, Din)
        window = pad.unfold(0, K, 1).permute(0, 1, 3, 2).reshape(T * Bn, K, Din)
        xc, delta, B, C = self._selective(mix, window)  # rows (t, b)
        A = -torch.exp(mix.A_log.float()).to(u.dtype)
        a = torch.mul(delta[..., None], A).exp_()  # (T·B, Din, N), in place: no second one
        b = torch.mul(delta[..., None], B[:, None, :]).mul_(xc[..., None])
        s = linear_scan(a.view(T, Bn, Din, N), b.view(T, Bn, Din, N), overwrite=True)
        y = self.readout(mix, s.view(T * Bn, Din, N), C, xc, z.reshape(T * Bn, Din))
        batch = lambda v: v.view(T, Bn, -1).transpose(0, 1)  # noqa: E731 - (B, T, ·) views
        parts = [conv_buffer(x.transpose(0, 1), K), batch(s)]
        return {"delta": batch(delta), "a": batch(a)}, parts, batch(y)

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[1]

    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:  # families/mamba_sweep.py
        return [replace(d, sweep=sweep(self, call, ref, MambaCell))
                for d in super().dynamics(call, ref)]

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0):
        """Edits inside the hand cell's steps from the first edited position on
        (families/official_edit.py); the module's own run before it."""
        from gatelens.families.official_edit import intervene

        return intervene(self, call, plan, output, offset)


class HFMambaFamily(MambaCell):
    """transformers' ``MambaModel`` (``MambaForCausalLM.backbone``)."""

    name = "hf-mamba"
    opens_what = "transformers' MambaModel / MambaForCausalLM (Mamba-1)"
    recipe = MAMBA_RECIPE

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == _HF and type(module).__name__ == "MambaModel"

    def mixers(self, m: nn.Module) -> list[nn.Module]:
        return [block.mixer for block in m.layers]

    def _act(self, mixer, x):
        return mixer.act(x)

    def split_call(self, args, kwargs):
        return hf_split(args, kwargs, "cache_params")

    def check(self, inputs, state=None) -> Call:
        return hf_check(self, inputs, state)

    def _forward(self, call: Call) -> Tensor:
        return self._output_of(self.own_output(call))

    def own_output(self, call: Call) -> Any:
        """What the module returns for the call (a ModelOutput), its cache off."""
        return self.module(inputs_embeds=call.inputs, use_cache=False)

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each block, its mixer and the mixer's in_proj, x_proj and out_proj, whose calls
        in one whole-sequence forward give every state (families/forward_scan.py).
        transformers' ``MambaMixer`` only (a subclass's mixer computes Δ, B, C its own way)."""
        if any(type(mix).__module__ != _HF or type(mix).__name__ != "MambaMixer"
               for mix in self.mixers(self.module)):
            return None
        mods: dict[str, nn.Module] = {}
        for k, block in enumerate(self.module.layers):
            mods.update({f"block{k}": block, f"mixer{k}": block.mixer,
                         f"in{k}": block.mixer.in_proj, f"xp{k}": block.mixer.x_proj,
                         f"out{k}": block.mixer.out_proj})
        return mods

    def scan_steps(self) -> dict[str, tuple[nn.Module, type]] | None:
        """Each mixer, with ``SequentialScanStates`` active in it: its sequential scan's own
        states are kept as it forms them (``layer_recorded``), so none is replayed."""
        if (mods := self.scan_modules()) is None:
            return None
        return {f"scan{k}": (mods[f"mixer{k}"], SequentialScanStates)
                for k in range(self.num_layers)}

    #: ``trajectory_recorded`` is each layer's ``layer_recorded`` side by side, so a layer's
    #: states can be replayed on their own (families/official_layers.py)
    layers_apart = True

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        """Each layer's ``layer_recorded``, and the largest gap of a replay's output against
        the module's own (``step_vs_forward``)."""
        L = self.num_layers
        layers = [self.layer_recorded(rec, k) for k in range(L)]
        gap = worst_of(g for _, _, g in layers)
        return {**rec.blocks(L), "parts": [p for p, _, _ in layers], "aux": [None] * L,
                "output": output, "own": [o for _, o, _ in layers], "step_vs_forward": gap}

    def layer_recorded(self, rec: Recorder, k: int) -> tuple[list[Tensor], dict, tuple]:
        """Layer k of ``trajectory_recorded``: the states its scan held where ``rec`` kept
        them (``scan_steps``), else the scan replayed on what its mixer's in_proj and x_proj
        returned (mamba1_scan): its parts, its own signals, and the output before out_proj
        from those states against the module's scan (abs, scaled)."""
        mix = self.mixers(self.module)[k]
        x, z = rec.stacked(f"in{k}", outputs=True).chunk(2, dim=-1)  # x, then the gate z
        sig, s, y = mamba1_scan(mix, rec.stacked(f"xp{k}"), rec.stacked(f"xp{k}", outputs=True),
                                z, rec.held(f"scan{k}"))
        gap = scaled_diff(y, rec.stacked(f"out{k}"))  # the states against the module's scan
        return [conv_buffer(x, self.d_conv), s], sig, gap

    def _output_of(self, returned: Any) -> Tensor:
        return returned.last_hidden_state

    def _trajectory(self, call: Call) -> dict:
        from transformers import DynamicCache

        L, K = self.num_layers, self.d_conv
        mods = {f"block{k}": b for k, b in enumerate(self.module.layers)}
        mods.update({f"mixer{k}": b.mixer for k, b in enumerate(self.module.layers)})
        cache = DynamicCache(config=self.module.config)
        states: list[list[Tensor]] = [[] for _ in range(L)]
        convs: list[list[Tensor]] = [[] for _ in range(L)]
        outs = []
        with Recorder(mods) as rec:
            for t in range(call.length):
                out = self.module(inputs_embeds=call.inputs[:, t : t + 1], cache_params=cache,
                                  use_cache=True)
                outs.append(out.last_hidden_state)
                for k in range(L):
                    s = cache.get_recurrent_state(k)  # (B, Din, N)
                    conv = cache.get_conv_state(k)[..., -(K - 1):]  # (B, Din, K − 1)
                    states[k].append(s.reshape(s.shape[0], 1, -1).clone())
                    convs[k].append(conv.transpose(1, 2).reshape(s.shape[0], 1, -1).clone())
        parts = [[torch.cat(convs[k], 1), torch.cat(states[k], 1)] for k in range(L)]
        return {**rec.blocks(L), "parts": parts, "aux": [None] * L,
                "output": torch.cat(outs, dim=1)}

    def pre(self, k, m, x):
        return m.layers[k].norm(x)

    def post(self, k, m, x, y):
        return x + y

    def final(self, m, x):
        return m.norm_f(x)


@torch.no_grad()
def mamba1_scan(mix: nn.Module, xh: Tensor, xproj: Tensor, z: Tensor,
                kept: SequentialScanStates | None = None
                ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """transformers' Mamba-1 selective scan replayed from what its mixer's x_proj received
    (``xh``: the convolution's activated output, (B, T, Din)) and returned (``xproj``:
    (B, T, rank + 2N)), with the package's own operations in its own layout and order
    (``mamba_selective_scan``'s sequential branch), so every state is the one its scan held.
    ``kept``: what its scan itself formed during that forward (forward_scan's
    SequentialScanStates, as a Recorder holds it): its states and keep are taken as they are
    where it has them, instead of replayed.
    Returns its Δ (B, T, Din) and keep a = exp(Δ A) (B, T, Din·N) as the mixer formed them
    (no "a" where ``kept`` held the states without it: a trace that skips the keep),
    s (B, T, Din·N), and the scan's output before out_proj, (C·s + D x̂) ⊙ silu(z)
    (B, T, Din), the figure the module's own is compared with."""
    N, rank = int(mix.ssm_state_size), int(mix.time_step_rank)
    Bn, T = xh.shape[:2]
    ts, Bm, Cm = torch.split(xproj, [rank, N, N], dim=-1)  # (B, T, ·) each
    time_step = mix.dt_proj.weight @ ts.transpose(1, 2)  # (B, Din, T), as the mixer forms it
    dt = F.softplus(time_step + mix.dt_proj.bias.float()[..., None])
    held = None if kept is None else kept.scan()
    if held is not None:  # the scan's own states and keep, (B, T, Din, N) each
        s, keep = held
    else:
        A = -torch.exp(mix.A_log.float())  # (Din, N)
        # exp in the mixer's own layout (its kernel rounds a tensor's last few elements by
        # another path), then time-major, the layout the recurrence walks
        dA = torch.mul(A[None, :, None, :], dt[:, :, :, None]).exp_()  # (B, Din, T, N)
        a = dA.permute(2, 0, 1, 3).contiguous()  # (T, B, Din, N)
        del dA
        dt_t = dt.permute(2, 0, 1)  # (T, B, Din); products are exact whatever the layout
        b = torch.mul(dt_t[..., None], Bm.transpose(0, 1)[:, :, None, :].float()).mul_(
            xh.transpose(0, 1)[..., None].float())  # (T, B, Din, N), in place: no second one
        s = linear_scan(a, b, overwrite=True).transpose(0, 1)  # (B, T, Din, N), over b
        keep = a.transpose(0, 1)
    y = (s.to(xh.dtype) @ Cm[..., None])[..., 0] + xh * mix.D  # (B, T, Din)
    sig = {"delta": dt.transpose(1, 2)} | ({} if keep is None else {"a": keep.flatten(2)})
    return sig, s.flatten(2), y * F.silu(z)
