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
from gatelens.families.registry import cell_names, check_build, recipe, recipes
from gatelens.training.fits import MAX_LAYERS, MAX_UNITS, check_bounds

#: ``--optimizer`` choices (gatelens.training.optim builds them with PyTorch's defaults).
OPTIMIZER_NAMES = ("adam", "sgd", "rmsprop")
#: ``--bias-init`` choices: PyTorch's own initialisation, or every recurrent bias 0.
BIAS_INITS = ("pytorch", "zero")
#: ``--cell`` choices: every registered family with a training recipe (families/registry.py:
#: PyTorch's and gatelens's cells, then the official implementations', gatelens[modern])
CELL_NAMES: tuple[str, ...] = cell_names()


@dataclass
class TrainConfig:
    corpus: str = "shakespeare"  # built-in corpus name or a UTF-8 text file's path
    cell: str = "lstm"  # a --cell name: a family with a training recipe (CELL_NAMES)
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
        for flag, v, most in (("--hidden", self.hidden, MAX_UNITS),
                              ("--embed", self.embed or 1, MAX_UNITS),
                              ("--layers", self.layers, MAX_LAYERS)):
            check_bounds(flag, v, most)  # beyond any model; its shapes stay computable
        r = recipe(self.cell)
        self.cell = r.name  # an alias (an earlier --cell name) becomes the family's name
        if self.nonlinearity not in ("tanh", "relu"):
            raise GatelensError(f"--nonlinearity must be tanh or relu, got {self.nonlinearity!r}")
        if self.nonlinearity != "tanh" and not r.takes("nonlinearity"):
            with_nl = [n for n, x in recipes().items() if x.takes("nonlinearity")]
            raise GatelensError(f"--nonlinearity applies to --cell {', '.join(with_nl)} only")
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or self.heads <= 0:
            raise GatelensError(f"--heads must be a positive integer, got {self.heads}")
        self._check_recipe(r)
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
        if not r.official and not r.takes("keep") and (
                self.forget_bias is not None or self.chrono is not None):
            flag = "--forget-bias" if self.forget_bias is not None else "--chrono"
            raise GatelensError(f"{flag} needs a gated cell (not {r.name}); a {r.name} has "
                                "no forget gate")
        if self.chrono is not None:
            check_chrono(self.chrono)
        if self.device not in ("auto", "cpu", "cuda"):
            raise GatelensError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        return self

    def _check_recipe(self, r) -> None:
        """What the cell's recipe cannot take (an official implementation embeds into
        --hidden and keeps its own init), and its rule for --hidden, --heads, --layers."""
        given = [flag for flag, on, key in (
            ("--embed", self.embed is not None, "embed"),
            ("--forget-bias", self.forget_bias is not None, "keep"),
            ("--chrono", self.chrono is not None, "keep"),
            (f"--bias-init {self.bias_init}", self.bias_init != "pytorch", "bias_init"))
            if on and not r.takes(key) and (r.official or key != "keep")]
        if given:
            why = (" (the official model embeds into --hidden and keeps its own init)"
                   if r.official else "")
            raise GatelensError(f"{given[0]} does not apply to --cell {self.cell}{why}")
        reason = check_build(r, self.hidden, self.layers, self.heads)
        if reason:
            raise GatelensError(reason)

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
