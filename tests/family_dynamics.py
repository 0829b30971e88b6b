"""A module's ``Dynamics`` through its family, exactly as ``divergence_rate`` builds them.

Tests load it through the ``dynamics_of`` fixture of conftest.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.cells.numerics import faithful_matmul
from gatelens.families.base import Dynamics
from gatelens.families.registry import open_family
from gatelens.families.torch_rnn import TorchRNNFamily


def dynamics_of(module: nn.Module, inputs: Tensor, state=None) -> list[Dynamics]:
    """One Dynamics per causal direction of ``module`` on ``inputs`` (B, T, F), batch first
    whatever the module's ``batch_first``, from ``state`` (zeros if None)."""
    fam = open_family(module, "dynamics_of()")
    x = inputs if getattr(module, "batch_first", True) or not isinstance(
        fam, TorchRNNFamily) else inputs.transpose(0, 1)
    call = fam.check(x, state)
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        ref = fam.reference(call)
    return fam.dynamics(call, ref)
