"""The training configuration: a typed dataclass, every field explained, validated.

>>> TrainConfig(hidden=0).validate()
Traceback (most recent call last):
...
gatelens.errors.GatelensError: --hidden must be a positive integer, got 0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from gatelens.errors import SEED_MAX, SEED_MIN, GatelensError
from gatelens.families.spec import FAMILIES, family_spec
from gatelens.training.official_model import OFFICIAL_CELLS, check_official, is_official

#: ``--optimizer`` choices (gatelens.training.optim builds them with PyTorch's defaults).
OPTIMIZER_NAMES = ("adam", "sgd", "rmsprop")
#: ``--bias-init`` choices: PyTorch's own initialisation, or every recurrent bias 0.
BIAS_INITS = ("pytorch", "zero")
#: ``--cell`` choices: PyTorch's and gatelens's cells, then the official implementations'
#: (training/official_model.py; the gatelens[modern] extra)
CELL_NAMES: tuple[str, ...] = FAMILIES + OFFICIAL_CELLS


@dataclass
class TrainConfig:
    corpus: str = "shakespeare"  # built-in corpus name or a UTF-8 text file's path
    cell: str = "lstm"  # lstm | gru | rnn | mingru | minlstm | slstm, or an official
    #                     implementation's (official_model.OFFICIAL_CELLS: xlstm-slstm ...)
    hidden: int = 325  # H, units per layer (the seed's 325)
    layers: int = 1  # stacked recurrent layers
    embed: int | None = None  # None: one-hot input, W_ih has a column per character
    nonlinearity: str = "tanh"  # plain RNN only: tanh | relu
    heads: int = 1  # sLSTM, xlstm-slstm, xlstm-mlstm only: heads (must divide hidden)
    steps: int = 800  # optimiser steps (the seed's 800)
    batch: int = 32  # windows per batch
    seq: int = 128  # characters per training window (targets are the next characters)
    lr: float = 2e-3  # learning rate (char-rnn's customary 2e-3 for Adam); any finite > 0
    clip: float = 5.0  # gradient clipping: max global L2 norm (finite; 1e9 is "no clipping")
    optimizer: str = "adam"  # adam | sgd | rmsprop, PyTorch's defaults but for lr
    bias_init: str = "pytorch"  # pytorch | zero: every bias of the recurrent module 0 at
    #                             step 0 (before forget_bias/chrono; the head keeps PyTorch's)
    forget_bias: float | None = None  # keep gate's total bias b_ih + b_hh (None: PyTorch's)
    chrono: float | None = None  # chrono initialisation T_max (None: off)
    eval_every: int = 100  # validation loss (and a checkpoint) every this many steps
    val_windows: int = 64  # validation windows of `seq` characters, evenly spaced
    seed: int = 0  # seeds weights, batches and everything random
    device: str = "auto"  # auto | cpu | cuda

    def validate(self) -> TrainConfig:
        """Raise GatelensError naming the first bad setting; return self."""
        for name in ("hidden", "layers", "steps", "batch", "seq", "eval_every", "val_windows"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise GatelensError(f"--{name.replace('_', '-')} must be a positive integer, "
                                    f"got {v}")
        if self.embed is not None and (not isinstance(self.embed, int)
                                       or isinstance(self.embed, bool) or self.embed <= 0):
            raise GatelensError(f"--embed must be a positive integer, got {self.embed}")
        if self.cell not in CELL_NAMES:
            raise GatelensError(f"--cell must be one of {', '.join(CELL_NAMES)}, "
                                f"got {self.cell!r}")
        if self.nonlinearity not in ("tanh", "relu"):
            raise GatelensError(f"--nonlinearity must be tanh or relu, got {self.nonlinearity!r}")
        if self.nonlinearity != "tanh" and self.cell != "rnn":
            raise GatelensError("--nonlinearity applies to --cell rnn only")
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or self.heads <= 0:
            raise GatelensError(f"--heads must be a positive integer, got {self.heads}")
        if is_official(self.cell):  # its own rule for --hidden and --heads
            self._check_official()
        elif self.heads != 1 and self.cell != "slstm":
            raise GatelensError("--heads applies to --cell slstm, xlstm-slstm, xlstm-mlstm only")
        elif self.hidden % self.heads:
            raise GatelensError(f"--heads {self.heads} must divide --hidden {self.hidden}")
        for name in ("lr", "clip"):
            v = getattr(self, name)
            if not _number(v) or not v > 0 or not math.isfinite(v):
                raise GatelensError(f"--{name} must be a positive finite number, got {v}")
        for name in ("forget_bias", "chrono"):
            v = getattr(self, name)
            if v is not None and (not _number(v) or not math.isfinite(v)):
                raise GatelensError(f"--{name.replace('_', '-')} must be a finite number, "
                                    f"got {v}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not (
                SEED_MIN <= self.seed <= SEED_MAX):
            raise GatelensError(f"--seed must be an integer from -2**63 to 2**64 - 1 (what "
                                f"PyTorch seeds from), got {self.seed}")
        if self.optimizer not in OPTIMIZER_NAMES:
            raise GatelensError(f"--optimizer must be one of {', '.join(OPTIMIZER_NAMES)}, "
                                f"got {self.optimizer!r}")
        if self.bias_init not in BIAS_INITS:
            raise GatelensError(f"--bias-init must be one of {', '.join(BIAS_INITS)}, "
                                f"got {self.bias_init!r}")
        if self.forget_bias is not None and self.chrono is not None:
            raise GatelensError("--forget-bias and --chrono are exclusive; give one")
        if not is_official(self.cell) and family_spec(self.cell).keep_gate is None and (
                self.forget_bias is not None or self.chrono is not None):
            flag = "--forget-bias" if self.forget_bias is not None else "--chrono"
            raise GatelensError(f"{flag} needs a gated cell (not rnn); a plain rnn has "
                                "no forget gate")
        if self.chrono is not None:
            check_chrono(self.chrono)
        if self.device not in ("auto", "cpu", "cuda"):
            raise GatelensError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        return self

    def _check_official(self) -> None:
        """What an official implementation's model cannot take: an embedding size (it
        embeds into --hidden), gatelens's keep-gate initialisers (its own init stands)."""
        given = [flag for flag, on in (("--embed", self.embed is not None),
                                        ("--forget-bias", self.forget_bias is not None),
                                        ("--chrono", self.chrono is not None),
                                        (f"--bias-init {self.bias_init}",
                                         self.bias_init != "pytorch"))
                 if on]
        if given:
            raise GatelensError(f"{given[0]} does not apply to --cell {self.cell} (the "
                                "official model embeds into --hidden and keeps its own init)")
        check_official(self.cell, self.hidden, self.layers, self.heads)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def check_chrono(t_max: float) -> None:
    """Chrono's T_max must exceed 2 (b_f ~ log U(1, T_max − 1) needs T_max − 1 > 1).

    >>> check_chrono(1.5)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --chrono TMAX must be above 2, got 1.5
    """
    if not t_max > 2:
        raise GatelensError(f"--chrono TMAX must be above 2, got {t_max}")


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
