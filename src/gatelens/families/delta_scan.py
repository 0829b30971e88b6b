"""Gated DeltaNet's and KDA's per-token states from ONE whole-sequence forward
(families/forward_scan.py does the same for the selective scans).

Both packages compute a prompt with the chunked delta rule (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``): the state at every token exists nowhere in that
computation, only at chunk boundaries. The layer runs its own whole-sequence forward once,
with forward hooks on its projections (what are module calls); the short convolution, which
is not a module call, is the package's own module-level ``causal_conv1d_fn`` on what the
projections returned, and the gates are formed with the forward's own operations. On these
q, k, v, g, β the package's recurrent step (``torch_recurrent_gated_delta_rule``,
``recurrent_kimi_delta_attention``: what its one-token decode path calls) is replayed along
the window in its own layout and operations, every state kept:

  S ← S · exp(g_t);  S ← S + k_t (β_t (v_t − Sᵀ k_t))ᵀ;  o_t = Sᵀ q_t   (S: d_k × d_v)

so the states and outputs are, bit for bit, what that function computes over the window
(tested), and within float32 rounding of the decode path itself (whose convolution runs one
window at a time). The chunked output of the forward against the replay's is
``step_vs_forward``, checked on every call, so a replay that parts from the module shows.

>>> q = k = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)  # (B, T, H, d_k)
>>> v, g, beta = torch.ones(1, 1, 1, 3), torch.zeros(1, 1, 1), torch.ones(1, 1, 1)
>>> S, o, _ = gdn_replay(q, k, v, g, beta, lambda x: x)
>>> S.shape, o[0, 0, 0].tolist()  # (B, T, H·d_v·d_k): S = v kᵀ, o = S q / √2
(torch.Size([1, 1, 6]), [0.7071067690849304, 0.7071067690849304, 0.7071067690849304])
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gatelens.families.buffers import state_empty
from gatelens.families.official import Recorder, conv_buffer, scaled_diff

__all__ = ["GDN_PACKAGE", "KDA_PACKAGE", "DeltaForward", "DeltaPackage", "delta_steps",
           "gdn_replay", "kda_replay", "package_function", "prompt_conv", "torch_path"]


def package_function(layer: nn.Module, name: str) -> Callable:
    """The module-level function ``name`` of the file that defines ``layer``'s class (the
    convolution, the l2norm the layer's forward calls)."""
    return getattr(sys.modules[type(layer).__module__], name)


def torch_path(layer: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``layer`` runs transformers' own PyTorch code: its class's forward (no hub
    kernel put in its place) and, for each of ``names``, the file's PyTorch function (not a
    fused kernel transformers found installed: fla, causal-conv1d)."""
    cls = type(layer)
    forward = getattr(cls.forward, "__module__", None)
    if "forward" in vars(layer) or forward != cls.__module__:
        return False
    for name in names:
        fn = package_function(layer, name)
        if hasattr(fn, "__wrapped__"):  # transformers' "kernel with a fallback" wrapper
            found = inspect.getclosurevars(fn).nonlocals
            if found.get("is_new_implementation", True):
                return False
    return True


@torch.no_grad()
def delta_steps(T: int, S: Tensor, at: Callable[[int], tuple[Tensor, ...]]
                ) -> Iterator[tuple[int, Tensor, Tensor]]:
    """The packages' recurrent delta-rule step along a window, in their operations and
    order from the state ``S`` (B, H, d_k, d_v; zeros for a prompt), which it updates in
    place: per t, ``at(t)`` gives (q_t, k_t, v_t, decay_t, β_t) as their loop slices them,
    decay_t already exp(g_t) in the shape that scales S; yields (t, S_t, o_t), S_t that one
    buffer (copy what you keep before the next step), o_t (B, H, d_v).

    Each product lands in one work tensor of S's shape and layout instead of a fresh one
    (the package allocates five a step), so every sum over d_k reads the layout the
    package's reads and the values are the package's bit for bit (tested)."""
    work = torch.empty_like(S)
    for t in range(T):
        q, k, v, decay, beta = at(t)
        S.mul_(decay)
        kv_mem = torch.mul(S, k.unsqueeze(-1), out=work).sum(dim=-2)
        delta = (v - kv_mem) * beta
        S.add_(torch.mul(k.unsqueeze(-1), delta.unsqueeze(-2), out=work))
        yield t, S, torch.mul(S, q.unsqueeze(-1), out=work).sum(dim=-2)


def _kept(T: int, shape: tuple[int, ...], at, like: Tensor) -> tuple[Tensor, Tensor]:
    """Every S_t of ``delta_steps`` written as the trace holds it, (B, T, H·d_v·d_k), each
    head's S (d_v × d_k) row by row, and every o_t, (B, T, H, d_v)."""
    B, H, dk, dv = shape
    states = state_empty((B, T, H, dv, dk), like.dtype, like.device)
    out = like.new_empty(B, T, H, dv)
    for t, S, o in delta_steps(T, like.new_zeros(shape), at):
        states[:, t].copy_(S.transpose(-1, -2))  # a copy; the next step reads S as it was
        out[:, t] = o
    return states.flatten(2), out


@torch.no_grad()
def gdn_replay(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               l2norm: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``torch_recurrent_gated_delta_rule`` along a whole window, every state kept: q, k
    (B, T, H_k, d_k), v (B, T, H_v, d_v), g, β (B, T, H_v) as the layer's forward passes them;
    ``l2norm`` the file's own. Returns S (B, T, H_v·d_v·d_k), o (B, T, H_v, d_v) and the
    signals the step used: α = exp(g) and β (B, T, H_v), the normalised k (B, T, H_v·d_k)
    and v (B, T, H_v·d_v), in float32 as the package steps."""
    Hk, (Hv, dv) = k.shape[2], v.shape[-2:]
    B, T, _, dk = k.shape
    if Hk != Hv:  # each key head serves H_v / H_k consecutive value heads
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]  # (B, H, T, ·)
    q, k = l2norm(q), l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    alpha = torch.empty_like(g)  # (B, H, T): the decay each step applied

    def at(t: int) -> tuple[Tensor, ...]:
        decay = g[:, :, t].exp()  # (B, H)
        alpha[:, :, t] = decay
        return q[:, :, t], k[:, :, t], v[:, :, t], decay[..., None, None], \
            beta[:, :, t].unsqueeze(-1)

    states, out = _kept(T, (B, Hv, dk, dv), at, v)
    sig = {"alpha": alpha.transpose(1, 2), "beta": beta.transpose(1, 2),
           "k": k.transpose(1, 2).flatten(2), "v": v.transpose(1, 2).flatten(2)}
    return states, out, sig


@torch.no_grad()
def kda_replay(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               l2norm: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``recurrent_kimi_delta_attention`` along a whole window, every state kept: q, k, v,
    g (B, T, H, d) and β (B, T, H) as KDA's forward passes them (g: one decay a key channel);
    ``l2norm`` the file's own. Returns S (B, T, H·d·d), o (B, T, H, d) and the signals:
    α = exp(g) (B, T, H·d), β (B, T, H), the normalised k and v (B, T, H·d), float32."""
    q, k, v, g, beta = [x.to(torch.float32) for x in (q, k, v, g, beta)]
    q, k = l2norm(q), l2norm(k)
    B, T, H, dk = k.shape
    q = q * (1 / (q.shape[-1] ** 0.5))
    alpha = torch.empty_like(g)  # (B, T, H, d_k)

    def at(t: int) -> tuple[Tensor, ...]:
        decay = g[:, t][..., None].exp()  # (B, H, d_k, 1): S's row j by α_j
        alpha[:, t] = decay[..., 0]
        return q[:, t], k[:, t], v[:, t], decay, beta[:, t][..., None]

    states, out = _kept(T, (B, H, dk, v.shape[-1]), at, v)
    return states, out, {"alpha": alpha.flatten(2), "beta": beta, "k": k.flatten(2),
                         "v": v.flatten(2)}


# ---- what each package's forward computed, from hooks on its module calls --------------
def prompt_conv(layer: nn.Module, mixed: Tensor, cached: bool = False) -> Tensor:
    """The layer's short convolution as its forward computes a prompt: the file's
    ``causal_conv1d_fn`` on the projections (B, T, conv_dim); ``cached``: the forward was
    given a cache, whose ``update_conv_state`` left-pads a window shorter than the kernel
    with zeros first. The activated output (B, T, conv_dim)."""
    T, K = mixed.shape[1], int(layer.conv_kernel_size)
    x = mixed.transpose(1, 2)  # (B, conv_dim, T)
    if cached and T < K:
        x = torch.nn.functional.pad(x, (K - T, 0), value=0)
    out = package_function(layer, "causal_conv1d_fn")(
        x, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, activation=layer.activation)
    return out[:, :, -T:].transpose(1, 2)


def gdn_hooked(layer: nn.Module) -> dict[str, nn.Module]:
    """The module calls of a Gated DeltaNet layer whose outputs the replay reads, by name:
    its projections (each variant's own) and the gated norm (its input: the chunked o)."""
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: fused, grouped by key head
        names = ("in_proj_qkvz", "in_proj_ba")
    elif hasattr(layer, "in_proj_qkv"):  # Qwen3.5
        names = ("in_proj_qkv", "in_proj_b", "in_proj_a")
    else:  # OLMo Hybrid
        names = ("q_proj", "k_proj", "v_proj", "b_proj", "a_proj")
    norm = layer.norm if hasattr(layer, "norm") else layer.o_norm
    return {**{n: getattr(layer, n) for n in names}, "norm": norm}


def gdn_inputs(layer: nn.Module, out: dict[str, Tensor], cached: bool = False
               ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """(the convolution's input (B, T, conv_dim), (q, k, v, g, β) as the forward hands them
    to the delta rule) from the hooked outputs, with the forward's own operations
    (``cached``: the forward was given a cache, ``prompt_conv``)."""
    if "in_proj_qkvz" in out:
        q, k, v, _, b, a = layer.fix_query_key_value_ordering(out["in_proj_qkvz"],
                                                              out["in_proj_ba"])
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
    elif "in_proj_qkv" in out:
        mixed, b, a = out["in_proj_qkv"], out["in_proj_b"], out["in_proj_a"]
    else:
        mixed = torch.cat([out["q_proj"], out["k_proj"], out["v_proj"]], dim=-1)
        b, a = out["b_proj"], out["a_proj"]
    B, T = mixed.shape[:2]
    q, k, v = torch.split(prompt_conv(layer, mixed, cached),
                          [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    beta = b.sigmoid()
    if getattr(layer, "allow_neg_eigval", False):  # OLMo Hybrid's β ∈ (0, 2)
        beta = beta * 2.0
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)
    return mixed, (q.reshape(B, T, -1, layer.head_k_dim), k.reshape(B, T, -1, layer.head_k_dim),
                   v.reshape(B, T, -1, layer.head_v_dim), g, beta)


def kda_hooked(layer: nn.Module) -> dict[str, nn.Module]:
    """KDA's module calls the replay reads: q, k, v, b projections, the forget gate (its g
    itself) and the gated norm (its input: the chunked o)."""
    names = ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate")
    return {**{n: getattr(layer, n) for n in names}, "norm": layer.o_norm}


def kda_inputs(layer: nn.Module, out: dict[str, Tensor], cached: bool = False
               ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``gdn_inputs`` for KDA: the forget gate's g (B, T, H, d) is a module's output."""
    mixed = torch.cat([out["q_proj"], out["k_proj"], out["v_proj"]], dim=-1)
    B, T = mixed.shape[:2]
    q, k, v = (x.view(B, T, -1, layer.head_dim)
               for x in torch.split(prompt_conv(layer, mixed, cached), [layer.qkv_dim] * 3,
                                    dim=-1))
    return mixed, (q, k, v, out["forget_gate"], torch.sigmoid(out["b_proj"]))


@dataclass(frozen=True)
class DeltaPackage:
    """How a package's delta-rule layer is read from its own forward."""

    #: the layer's module calls to hook, by name ("norm": the gated norm, whose input is
    #: the chunked output o)
    hooked: Callable[[nn.Module], dict[str, nn.Module]]
    #: (the convolution's input, (q, k, v, g, β)) from the hooked modules' outputs, and
    #: whether the forward was given a cache
    inputs: Callable[[nn.Module, dict[str, Tensor], bool], tuple[Tensor, tuple[Tensor, ...]]]
    #: the package's recurrent step along the window (``gdn_replay``, ``kda_replay``)
    replay: Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]
    #: the file's functions the forward and the decode path call (a fused kernel in their
    #: place computes another way: the decode path is read then)
    functions: tuple[str, ...]


GDN_PACKAGE = DeltaPackage(gdn_hooked, gdn_inputs, gdn_replay, (
    "causal_conv1d_fn", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"))
KDA_PACKAGE = DeltaPackage(kda_hooked, kda_inputs, kda_replay, (
    "causal_conv1d_fn", "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"))


class DeltaForward:
    """The delta-rule families' states from the layer's own forward (hf_gated_deltanet.py,
    hf_kda.py): ``scan_modules`` and ``trajectory_recorded`` (``open_cells`` reads the user's
    own forward with them), and ``_forward_trajectory``, which runs that forward with a fresh
    cache so that it also leaves the chunked path's final state. On the family's ``layers``,
    ``_stack``, ``_run``, ``_cache``, ``_carried`` and ``shape``."""

    package: DeltaPackage = GDN_PACKAGE

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Each layer's hooked module calls (``DeltaPackage.hooked``) and the module itself
        (a stack: its norms, layers and final norm); None where a layer does not run the
        package's PyTorch code."""
        layers, pkg = self.layers(self.module), self.package
        if not all(torch_path(g, pkg.functions) for g in layers):
            return None
        mods = {f"{k}.{n}": mod for k, g in enumerate(layers) for n, mod in pkg.hooked(g).items()}
        if not self._stack:
            return {**mods, "module": self.module}
        m = self.module
        mods.update({f"{k}.{n}": mod for k in range(len(layers))
                     for n, mod in (("block", m.norms[k]), ("layer", layers[k]))})
        return {**mods, "final": m.norm_f}

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        return self._recorded(rec, output, None)

    def _forward_trajectory(self, call):
        """Every state from one whole-sequence forward (module docstring) given a fresh
        cache, so that it also leaves the chunked path's final state (``own``'s "final", for
        ``final_vs_step``)."""
        mods = self.scan_modules()
        if mods is None:
            return None
        cache = self._cache(call.batch, call.inputs, primed=False)
        with Recorder(mods) as rec:
            output = self._run(call.inputs, cache)
        return self._recorded(rec, output, cache)

    def _recorded(self, rec: Recorder, output: Tensor, cache) -> dict:
        """The trajectory from a recorded forward: per layer the package's convolution and
        gates on what the projections returned, its recurrent step replayed on them, the
        chunked output (the gated norm's input) against the replay's (``step_vs_forward``);
        ``cache``: the one the forward was given (None: it had none)."""
        layers, pkg = self.layers(self.module), self.package
        L, K = len(layers), self.shape[4]
        parts, own, gap = [], [], (0.0, 0.0)
        for k, g in enumerate(layers):
            mixed, args = pkg.inputs(g, {n: rec.stacked(f"{k}.{n}", outputs=True)
                                         for n in pkg.hooked(g) if n != "norm"},
                                     cache is not None)
            S, o, sig = pkg.replay(*args, package_function(g, "l2norm"))
            d = scaled_diff(o, rec.stacked(f"{k}.norm").view(o.shape))  # chunked vs replay
            gap = (max(gap[0], d[0]), max(gap[1], d[1]))
            parts.append([conv_buffer(mixed, K), S])
            own.append({n: v.to(output.dtype) for n, v in sig.items()})
            if cache is not None:
                own[-1]["final"] = self._carried(cache.layers[g.layer_idx])[1][:, 0]
        if self._stack:
            x = [rec.stacked(f"{k}.block") for k in range(L)]
            u = [rec.stacked(f"{k}.block", outputs=True) for k in range(L)]
            y = [rec.stacked(f"{k}.layer", outputs=True) for k in range(L)]
            xo = x[1:] + [rec.stacked("final")]
        else:
            x = u = [rec.stacked("module")]
            y = xo = [output]
        return {"x": x, "u": u, "y": y, "xo": xo, "parts": parts, "aux": [None] * L,
                "output": output, "own": own, "step_vs_forward": gap}
