"""Where an edited run starts: the module's own state after its first n steps, and its own
output on them (families/official_edit.py).

An edited run needs, at its first edited position n, the state the module itself carried
into it. The general way is the module's own step path on those n steps
(``reference`` of the call cut to n steps: n one-token calls of its decode path, cost in
proportion to n, not to the window). A family whose package takes a cache in its
whole-sequence forward gives it at the cost of one forward of n steps (a prefill): the
cache holds the state after the last of them, in the package's own computation.
transformers' Mamba-1 and Mamba-2 (and FalconMamba) do; their decode step on the CPU is
~30× a step of their forward (the reference kernels' one-token path), so a late edit there
would otherwise cost many forwards.

``start(fam, call, n)`` returns ``Start``: the module's output on the n steps (as the
family's ``own_output`` gives it, or None), each layer's dynamic parts after step n − 1
(the family's ``_trajectory`` layout), and each layer's ``aux`` at n − 1 (xLSTM's
stabiliser; None where the family has none).

>>> import torch
>>> from transformers import MambaConfig, MambaModel
>>> from gatelens.families.hf_mamba import HFMambaFamily
>>> cfg = MambaConfig(vocab_size=7, hidden_size=8, state_size=4, num_hidden_layers=2,
...                   expand=2, conv_kernel=3, time_step_rank=2)
>>> fam = HFMambaFamily(MambaModel(cfg).eval())
>>> call = fam.check(torch.randint(0, 7, (2, 6)))
>>> got = start(fam, call, 4)
>>> ref = fam.reference(call)  # the decode path, one token at a time
>>> all(float((p - q[:, 3]).abs().max()) < 1e-6 for k in range(2)
...     for p, q in zip(got.parts[k], ref.extra["parts"][k]))
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gatelens.families.base import Call

__all__ = ["Start", "cut", "start"]


@dataclass
class Start:
    """The module after its first n steps: ``output`` (what it returns on them, or None),
    ``parts`` per layer (B, ·) each, ``aux`` per layer ((B, ·) or None)."""

    output: Any
    parts: list[list[Tensor]]
    aux: list[Tensor | None]


def cut(call: Call, n: int) -> Call:
    """``call`` on its first n steps (its inputs and any per-step tensor of its layout)."""
    T = call.length

    def part(v: Any) -> Any:
        return v[:, :n] if isinstance(v, Tensor) and v.ndim >= 2 and v.shape[1] == T else v

    return Call(call.inputs[:, :n], call.state, {k: part(v) for k, v in call.layout.items()})


def _hf_mamba(fam: Any, call: Call, n: int, output: bool) -> Start:
    """transformers' Mamba / Mamba-2 / FalconMamba backbone: one forward of the n steps
    with its DynamicCache, whose conv and recurrent states are the parts after them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=fam.module.config)
    out = fam.module(inputs_embeds=call.inputs[:, :n], cache_params=cache, use_cache=True)
    B, K, parts = call.batch, fam.d_conv, []
    for k in range(fam.num_layers):
        s = cache.get_recurrent_state(k)
        conv = cache.get_conv_state(k)[..., -(K - 1):]  # (B, channels, K − 1), oldest first
        parts.append([conv.transpose(1, 2).reshape(B, -1).double(), s.reshape(B, -1).double()])
    return Start(out, parts, [None] * fam.num_layers)


def _prefill(fam: Any):
    """The family's prefill, where its package has one (see the module docstring)."""
    from gatelens.families.mamba_edit import base

    return _hf_mamba if base(fam, "HFMambaFamily") is not None else None


def start(fam: Any, call: Call, n: int, output: bool = True) -> Start:
    """The module's own state after its first ``n`` ≥ 1 steps of ``call`` (module
    docstring): a prefill where the package has one, else its step path on those steps;
    ``output``: also what the module returns on them (``own_output``)."""
    prefill, first = _prefill(fam), cut(call, n)
    with torch.no_grad():
        if prefill is not None:
            return prefill(fam, call, n, output)
        ref = fam.reference(first)
        own = getattr(fam, "own_output", None)
        out = own(first) if output and own is not None else None
    aux = [None if a is None else a[:, -1] for a in ref.extra["aux"]]
    return Start(out, [[p[:, -1] for p in ref.extra["parts"][k]] for k in range(fam.num_layers)],
                 aux)
