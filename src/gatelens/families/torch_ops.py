"""Small tensor helpers the PyTorch families share (differences, the state each step reads,
a module of some of a module's own tensors)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def max_diff(a: Tensor, b: Tensor, scaled: bool = False) -> float:
    """max |a − b| in float64, or with ``scaled`` max |a − b| / max(1, |b|); 0 when empty.

    >>> max_diff(torch.tensor([30.0]), torch.tensor([30.0003]), scaled=True) < 1e-5
    True
    """
    if not a.numel():
        return 0.0
    diff = (a.double() - b.double()).abs()
    if scaled:
        diff = diff / b.double().abs().clamp(min=1.0)
    return float(diff.max())


def previous(seq: Tensor, init: Tensor, reverse: bool) -> Tensor:
    """The state each step reads, (B, T, ·): init, then the step before in processing order."""
    init = init.unsqueeze(1)  # (B, 1, ·)
    if reverse:
        return torch.cat([seq[:, 1:], init], dim=1)
    return torch.cat([init, seq[:, :-1]], dim=1)


def like(module: nn.RNNBase, num_layers: int, tensors: dict[str, Tensor], *,
         bidirectional: bool, input_size: int) -> nn.RNNBase:
    """A fresh eval module of ``module``'s class holding ``tensors`` (PyTorch's names),
    built on the meta device so no weight is initialised, then given the tensors as they
    are (shared, never copied)."""
    kw: dict[str, Any] = dict(num_layers=num_layers, bias=module.bias, batch_first=True,
                              bidirectional=bidirectional)
    if isinstance(module, nn.LSTM):
        kw["proj_size"] = module.proj_size
    if isinstance(module, nn.RNN):
        kw["nonlinearity"] = module.nonlinearity
    with torch.device("meta"):
        fresh = type(module)(input_size, module.hidden_size, **kw)
    fresh.load_state_dict(tensors, assign=True)
    return fresh.eval()
