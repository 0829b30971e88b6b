"""The registry of families: one line each, in the order they are tried.

A family file must import its optional package (xlstm, transformers, onnx ...) only inside
its methods, never at import time, so ``import gatelens`` stays light and a missing extra
only matters when a model of that kind is opened.
"""

from __future__ import annotations

from importlib import import_module

from torch import nn

#: "module:Class" of every family, in the order ``family_of`` tries them.
FAMILIES: tuple[str, ...] = (
    "gatelens.families.lstm:LSTMFamily",
    "gatelens.families.gru:GRUFamily",
    "gatelens.families.rnn:RNNFamily",
    # cells stepped by the caller, opened as the one-layer module (families/torch_cell.py)
    "gatelens.families.torch_cell:LSTMCellFamily",
    "gatelens.families.torch_cell:GRUCellFamily",
    "gatelens.families.torch_cell:RNNCellFamily",
    "gatelens.families.modern:MinGRUFamily",
    "gatelens.families.modern:MinLSTMFamily",
    "gatelens.families.modern:SLSTMFamily",
    # cells PyTorch has no module for (ONNX peepholes, reset-before GRU, Keras activations)
    "gatelens.families.variants:VariantLSTMFamily",
    "gatelens.families.variants:VariantGRUFamily",
    # the official implementations (gatelens[modern]); each tests its class by module path
    "gatelens.families.xlstm_slstm:XLSTMSLSTMFamily",
    "gatelens.families.xlstm_mlstm:XLSTMMLSTMFamily",
    "gatelens.families.mingru_pytorch:MinGRUPytorchFamily",
    "gatelens.families.hf_mamba:HFMambaFamily",
    "gatelens.families.hf_mamba2:HFMamba2Family",
    "gatelens.families.mambapy:MambapyFamily",
    "gatelens.families.hf_rwkv:HFRwkvFamily",
)


def family_classes() -> list[type]:
    """The family classes, loaded."""
    out = []
    for entry in FAMILIES:
        mod, cls = entry.split(":")
        out.append(getattr(import_module(mod), cls))
    return out


def family_of(module: object):
    """The family that opens ``module`` (an instance bound to it), or None."""
    if not isinstance(module, nn.Module):
        return None
    for cls in family_classes():
        if cls.opens(module):
            return cls(module)
    return None


def open_family(module: object, what: str = "trace()"):
    """The family of ``module``; TypeError naming what is supported otherwise.

    >>> open_family(object())
    Traceback (most recent call last):
    ...
    TypeError: trace() takes nn.LSTM, nn.GRU, nn.RNN (tanh or relu), ...; got object
    """
    fam = family_of(module)
    if fam is None:
        raise TypeError(f"{what} takes {supported()}; got {type(module).__name__}")
    return fam


def supported() -> str:
    """What the registered families open, in words (the one list of supported classes)."""
    return ", ".join(cls.opens_what for cls in family_classes())
