"""nn.RNN (tanh or relu) as a family: the pre-activation from the layer's input and
PyTorch's own h_{t−1}; h itself is PyTorch's.

>>> import torch
>>> from gatelens.families.registry import family_of
>>> fam = family_of(torch.nn.RNN(3, 4, nonlinearity="relu"))
>>> fam.cell, fam.names()
('rnn_relu', ['layer0.pre', 'layer0.h'])
"""

from __future__ import annotations

from torch import Tensor, nn

from gatelens.families.gru import TorchFamilyNoCell
from gatelens.families.spec import TANH, CellSpec
from gatelens.families.torch_train import torch_recipe

RNN_TANH = CellSpec(
    name="rnn_tanh", kind="rnn", mode="RNN_TANH", chunks=("pre",), signals=("pre", "h"),
    gates=(), keep_gate=None, input_gate=None, state="h", bounds={"h": TANH}, carried=("h",))
RNN_RELU = CellSpec(
    name="rnn_relu", kind="rnn", mode="RNN_RELU", chunks=("pre",), signals=("pre", "h"),
    gates=(), keep_gate=None, input_gate=None, state="h", carried=("h",))


class RNNFamily(TorchFamilyNoCell):
    """nn.RNN, tanh or relu, any layers, directions, bias."""

    name = "rnn"
    opens_what = "nn.RNN (tanh or relu)"
    module_class = nn.RNN
    specs = (RNN_TANH, RNN_RELU)
    recipe = torch_recipe("rnn", nn.RNN, specs, "", "PyTorch's nn.RNN (--nonlinearity tanh "
                          "or relu; no keep gate)", nonlinearity=True)

    def gates(self, xw: Tensor, hw: Tensor) -> dict[str, Tensor]:
        return {"pre": xw + hw}
