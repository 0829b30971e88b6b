"""PyTorch's own float32 numerics while gatelens computes: TF32 off on CUDA, and oneDNN's
note about projections silenced (its fallback is PyTorch's own path).

>>> import torch
>>> with faithful_matmul(torch.device("cpu")):
...     float(torch.ones(2) @ torch.ones(2))
2.0
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def faithful_matmul(device: torch.device) -> Iterator[None]:
    """Turn TF32 off on CUDA for the duration: TF32 GEMMs are not PyTorch's float32 numerics."""
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@contextlib.contextmanager
def quiet_onednn() -> Iterator[None]:
    """oneDNN cannot run a projected LSTM and warns before PyTorch's own path takes over."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*projections is not supported with oneDNN")
        yield
