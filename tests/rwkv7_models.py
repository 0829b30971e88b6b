"""The rwkv package's RWKV-7 for tests: the package imported with ``RWKV_V7_ON=1`` (it
defines ``RWKV_x070`` at import time, so the variable is set here, before any test file's
first import of ``rwkv.model``) and a random checkpoint in its own layout, which the package
itself loads (``torch.save`` of tensors here; gatelens never loads a ``.pth``)."""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path

import torch

os.environ["RWKV_V7_ON"] = "1"
with warnings.catch_warnings():  # torch 2.10 deprecates the torch.jit the package scripts with
    warnings.simplefilter("ignore", DeprecationWarning)
    pkg = importlib.import_module("rwkv.model")
assert hasattr(pkg, "RWKV_x070"), "rwkv.model was imported before RWKV_V7_ON=1 was set"

V, C, H, N, FF, LORA = 11, 32, 2, 16, 64, 4


def weights(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random checkpoint in the package's own layout (its names and shapes)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return scale * torch.randn(*shape, generator=g)

    def near1(n):
        return 1 + r(n, scale=0.1)

    z = {"emb.weight": r(V, C, scale=1.0), "blocks.0.ln0.weight": near1(C),
         "blocks.0.ln0.bias": r(C, scale=0.1), "ln_out.weight": near1(C),
         "ln_out.bias": r(C, scale=0.1), "head.weight": r(V, C)}
    for i in range(layers):
        b, a, f = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        for n in ("ln1", "ln2"):
            z[f"{b}{n}.weight"], z[f"{b}{n}.bias"] = near1(C), r(C, scale=0.1)
        for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            z[a + n] = torch.rand(1, 1, C, generator=g)
        for n in ("w", "a", "v", "g"):
            if n == "v" and i == 0:
                continue  # layer 0's v is v_first itself: no v0, v1, v2
            if n != "g":
                z[f"{a}{n}0"] = r(1, 1, C, scale=1.0)
            z[f"{a}{n}1"], z[f"{a}{n}2"] = r(C, LORA), r(LORA, C)
        z[a + "k_k"], z[a + "k_a"] = near1(C).view(1, 1, C), near1(C).view(1, 1, C)
        z[a + "r_k"] = r(H, N)
        for n in ("receptance", "key", "value", "output"):
            z[f"{a}{n}.weight"] = r(C, C, scale=C ** -0.5)
        z[a + "ln_x.weight"], z[a + "ln_x.bias"] = near1(C), r(C, scale=0.1)
        z[f + "x_k"] = torch.rand(1, 1, C, generator=g)
        z[f + "key.weight"], z[f + "value.weight"] = r(FF, C, scale=C ** -0.5), \
            r(C, FF, scale=FF ** -0.5)
    return z



def build(path: Path, layers: int, seed: int = 0):
    """(the tensors, the package's model built from them), saved at ``path``.pth."""
    z = weights(layers, seed)
    torch.save(z, f"{path}.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return z, pkg.RWKV_x070(str(path), "cpu fp32")
