"""The float64 copy of a large module without a float64 copy of its largest weights.

The hand cell and the dynamics of an official family run on a float64 copy of the module
(``OfficialFamily.float64``). At 24 layers of mamba2-130m's shape that copy is 0.67 GiB,
nearly all of it the mixers' in_proj and out_proj, held for the whole analysis beside the
clean states. Here each ``nn.Linear`` of at least ``UPCAST_NUMBERS`` weights is copied as an
``UpcastLinear``: it keeps the module's own float32 weight (shared, never converted, not one
of the copy's parameters) and widens it at each call, so the copy computes what a float64
copy computes, bit for bit (widening is exact), with none of those weights held in float64.
A family takes it where its hand cell reads each Linear over many rows a call (the Mamba
cells: a piece of the window, a whole layer); where it steps a token at a time the widening
would cost more than the copy (4× on one block of xLSTM-7B's width), and its copy holds
every weight (``Family.float64_memo``).

>>> import copy, torch
>>> lin = torch.nn.Linear(4, 3)
>>> m = torch.nn.Sequential(lin)
>>> m64 = copy.deepcopy(m, upcast_memo(m, numbers=1)).double()
>>> x = torch.randn(2, 4, dtype=torch.float64)
>>> torch.equal(m64(x), copy.deepcopy(m).double()(x)), lin.weight.dtype
(True, torch.float32)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.families.torch_ops import no_embedding

__all__ = ["UPCAST_NUMBERS", "UpcastLinear", "float64_memo", "upcast_memo"]

#: the fewest weights of an nn.Linear that the float64 copy widens at each call instead of
#: holding in float64 (8 MiB a weight and up: Mamba's in_proj and out_proj at 768 wide)
UPCAST_NUMBERS = 2**20


class UpcastLinear(nn.Module):
    """``linear`` of a float64 copy: its weight widened from the module's own at each call
    (``weight``), its bias copied (and converted with the copy)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # not registered: ``.double()`` on the copy must leave the module's own weight alone
        self.__dict__["source"] = linear
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> Tensor:
        """The module's own weight, widened to float64 (the copy's dtype)."""
        return self.source.weight.detach().double()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, widened"


def upcast_memo(module: nn.Module, numbers: int | None = None) -> dict[int, nn.Module]:
    """A ``deepcopy`` memo that copies each ``nn.Linear`` of ``module`` with at least
    ``numbers`` weights (``UPCAST_NUMBERS``) as an ``UpcastLinear`` of it (the copy is then
    converted to float64 with ``.double()``)."""
    numbers = UPCAST_NUMBERS if numbers is None else numbers
    return {id(m): UpcastLinear(m) for m in module.modules()
            if type(m) is nn.Linear and m.weight.numel() >= numbers}


def float64_memo(module: nn.Module) -> dict[int, nn.Module]:
    """The ``deepcopy`` memo of a Mamba family's float64 copy: no input embedding table
    (``torch_ops.no_embedding``) and the largest Linear weights widened at each call."""
    return no_embedding(module) | upcast_memo(module)
