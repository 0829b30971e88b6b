"""PyTorch's own computation, as the reference a read-out is checked against.

Verification, the parallel read-out and the hooks need the same three things from
PyTorch: a module's output in one layout (``output_batch_first``), a fresh module holding
copies of some of a module's layers (PyTorch returns only the top layer's sequence, so a
lower layer's is had by running a copy of the layers up to it), and float32 numerics that
are PyTorch's own on CUDA too (``faithful_matmul``: TF32 off).

>>> import torch
>>> lstm = torch.nn.LSTM(3, 4, num_layers=3)
>>> low = copy_layers(lstm, 0, 2, batch_first=True)
>>> low.num_layers, bool(torch.equal(low.weight_hh_l1, lstm.weight_hh_l1))
(2, True)
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence


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


def copy_layers(module: nn.RNNBase, start: int, count: int, batch_first: bool) -> nn.RNNBase:
    """A fresh module of the same class (eval) holding copies of layers start … start+count−1.

    The user's module is only read; verification and the parallel path run the copy.
    """
    kw = dict(num_layers=count, bias=module.bias, batch_first=batch_first,
              bidirectional=module.bidirectional)
    if isinstance(module, nn.LSTM):
        kw["proj_size"] = module.proj_size
    if isinstance(module, nn.RNN):
        kw["nonlinearity"] = module.nonlinearity
    w = getattr(module, f"weight_ih_l{start}")
    fresh = type(module)(w.shape[1], module.hidden_size, **kw).to(w.device, w.dtype).eval()
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            k = int(re.search(r"_l(\d+)", name).group(1))
            p.copy_(getattr(module, re.sub(r"_l\d+", f"_l{start + k}", name, count=1)))
    return fresh


def output_batch_first(module: nn.RNNBase, output: tuple) -> tuple[Tensor, Tensor, Tensor | None]:
    """A module's (output, state) as output (B, T, D*H_out), h_n and c_n (None but LSTM)."""
    out, hn = output
    if isinstance(out, PackedSequence):
        out, _ = pad_packed_sequence(out, batch_first=True)
    elif out.ndim == 2:  # unbatched
        out = out.unsqueeze(0)
    elif not module.batch_first:
        out = out.transpose(0, 1)
    h_n, c_n = hn if isinstance(hn, tuple) else (hn, None)
    return out, h_n, c_n




def run_module(module: nn.RNNBase, inputs: Tensor | PackedSequence,
               state=None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The module's own output as (B, T, D*H_out), h_n and c_n, under no_grad."""
    with torch.no_grad(), warnings.catch_warnings():
        # oneDNN cannot do projections and says so; the fallback is PyTorch's own path.
        warnings.filterwarnings("ignore", message=".*projections is not supported with oneDNN")
        return output_batch_first(module, module(inputs, state))
