"""One place that seeds everything random."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and PyTorch (CPU and CUDA) from one integer.

    >>> set_seed(3); a = torch.rand(2); set_seed(3); bool((a == torch.rand(2)).all())
    True
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
