"""The registry of families: one line each, in the order they are tried.

Everything else about a family lives in its own file: how it recognises its module
(``opens``), the ``CellSpec`` of each cell it opens (``specs``) and, for a family that can
be trained with ``gatelens train --cell NAME``, its ``Recipe`` (``recipe``). Every list of
supported modules, ``--cell`` choice, keep-gate wording and trace name elsewhere is read
from here, so adding a family is its file and one line below, or, for a family outside
gatelens, one of:

- ``register("package.module:Class")`` in Python, before the model is opened;
- the environment variable ``GATELENS_FAMILIES="package.module:Class,..."`` (it reaches
  the command line and a study's Ray workers too);
- an entry point in the group ``gatelens.families`` of an installed package.

A family file must import its optional package (xlstm, transformers, onnx ...) only inside
its methods, never at import time, so ``import gatelens`` stays light and a missing extra
only matters when a model of that kind is opened.

>>> cell_spec("gru").keep_gate, recipe("mingru-lm").name, "hf-mamba" in cell_names()
('z', 'mingru-pytorch', True)
>>> gate_names("gru", 2)
['layer0.r', 'layer0.z', 'layer0.n', 'layer0.h', 'layer1.r', 'layer1.z', 'layer1.n', 'layer1.h']
>>> gate_names("lstm", 1, proj=True)[-2:]
['layer0.m', 'layer0.h']
"""

from __future__ import annotations

import os
from functools import cache
from importlib import import_module, metadata

from torch import nn

from gatelens.errors import GatelensError
from gatelens.families.recipe import Recipe
from gatelens.families.spec import CellSpec, letters_of, names_of

#: "module:Class" of every built-in family, in the order ``family_of`` tries them.
BUILTIN: tuple[str, ...] = (
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
    "gatelens.families.xlstm_mixed:XLSTMMixedFamily",  # before the one-kind stacks
    "gatelens.families.xlstm_slstm:XLSTMSLSTMFamily",
    "gatelens.families.xlstm_mlstm:XLSTMMLSTMFamily",
    "gatelens.families.mingru_pytorch:MinGRUPytorchFamily",
    "gatelens.families.hf_mamba:HFMambaFamily",
    "gatelens.families.hf_mamba2:HFMamba2Family",
    "gatelens.families.hf_falcon_mamba:HFFalconMambaFamily",
    "gatelens.families.hf_mamba2_mixers:HFMamba2MixerFamily",
    "gatelens.families.hf_rwkv:HFRwkvFamily",
    "gatelens.families.hf_gated_deltanet:HFGatedDeltaNetFamily",
    "gatelens.families.hf_rglru:HFRGLRUFamily",
    "gatelens.families.hf_jamba:HFJambaFamily",
    "gatelens.families.hf_kda:HFKDAFamily",
    "gatelens.families.rwkv7:RWKV7Family",
    "gatelens.families.hf_xlstm:HFXLSTMFamily",
    "gatelens.families.mambapy:MambapyFamily",
)
#: kept for code that read the old name
FAMILIES = BUILTIN
#: the environment variable that adds families ("module:Class,...")
ENV = "GATELENS_FAMILIES"
#: the entry-point group that adds families from installed packages
ENTRY_POINTS = "gatelens.families"

_added: list[str] = []


def register(entry: str) -> None:
    """Add a family ("package.module:Class") after the built-in ones; it is tried last.

    The class is loaded at once, so a wrong name fails here, in one line.
    """
    _load(entry)
    if entry not in _added:
        _added.append(entry)


def _load(entry: str) -> type:
    mod, _, cls = entry.partition(":")
    try:
        return getattr(import_module(mod), cls)
    except (ImportError, AttributeError, ValueError) as e:
        raise GatelensError(f"family {entry!r} (module:Class) cannot be loaded: {e}") \
            from None


@cache
def _entry_points() -> tuple[str, ...]:
    """The installed packages' families (read once a process: it scans every package)."""
    return tuple(ep.value for ep in metadata.entry_points(group=ENTRY_POINTS))


def _entries() -> tuple[str, ...]:
    env = [e.strip() for e in os.environ.get(ENV, "").split(",") if e.strip()]
    return tuple(dict.fromkeys([*BUILTIN, *_added, *env, *_entry_points()]))


@cache
def _classes(entries: tuple[str, ...]) -> tuple[type, ...]:
    return tuple(_load(e) for e in entries)


def family_classes() -> list[type]:
    """The family classes, loaded, in the order they are tried."""
    return list(_classes(_entries()))


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


@cache
def _tables(entries: tuple[str, ...]) -> tuple[dict[str, CellSpec], dict[str, Recipe]]:
    """The cells' specs by trace name and the recipes by ``--cell`` name of these families
    (the first family declaring a name wins), built once per list of families."""
    specs: dict[str, CellSpec] = {}
    recipes: dict[str, Recipe] = {}
    for cls in _classes(entries):
        for spec in cls.specs:
            specs.setdefault(spec.name, spec)
        if cls.recipe is not None:
            recipes.setdefault(cls.recipe.name, cls.recipe)
    return specs, recipes


# ---- cells: the trace names ------------------------------------------------------------
def cell_specs() -> dict[str, CellSpec]:
    """Every cell's spec by its trace name, from the families' ``specs``."""
    return dict(_tables(_entries())[0])


def cell_spec(cell: str) -> CellSpec:
    """The spec of a trace cell name; a clear error for an unknown one.

    >>> cell_spec("rnn_relu").kind
    'rnn'
    """
    specs = _tables(_entries())[0]
    try:
        return specs[cell]
    except KeyError:
        raise ValueError(f"unknown cell {cell!r}; expected one of {sorted(specs)}") from None


def signals(cell: str, proj: bool = False) -> tuple[str, ...]:
    """Signal letters of one layer and direction, with ``m`` before ``h`` when projected.

    >>> signals("lstm", proj=True)
    ('i', 'f', 'g', 'o', 'c', 'm', 'h')
    """
    return letters_of(cell_spec(cell), proj)


def gate_names(cell: str, num_layers: int, bidirectional: bool = False,
               proj: bool = False) -> list[str]:
    """The exact list of names a Trace of this configuration holds, in order.

    ``proj=True`` (an LSTM with ``proj_size > 0``) adds ``m`` before each ``h``.

    >>> gate_names("rnn_tanh", 1, bidirectional=True)
    ['layer0.pre', 'layer0.h', 'layer0.reverse.pre', 'layer0.reverse.h']
    """
    return names_of(cell_spec(cell), num_layers, bidirectional, proj)


# ---- recipes: what `gatelens train --cell` builds ---------------------------------------
def recipes() -> dict[str, Recipe]:
    """Every trainable family's recipe by its name, in the order ``--cell`` lists them."""
    return dict(_tables(_entries())[1])


def builtin_recipes() -> dict[str, Recipe]:
    """The recipes of gatelens's own families (``BUILTIN``), not of registered ones."""
    return dict(_tables(BUILTIN)[1])


def cell_names() -> tuple[str, ...]:
    """The ``--cell`` choices (each family's one name), in order."""
    return tuple(recipes())


def canonical(name: str) -> str:
    """The family's one name for a ``--cell`` value or an alias of it (unknown: as given).

    >>> canonical("mingru-lm"), canonical("gru"), canonical("nope")
    ('mingru-pytorch', 'gru', 'nope')
    """
    for r in recipes().values():
        if name == r.name or name in r.aliases:
            return r.name
    return name


def recipe(name: str) -> Recipe:
    """The recipe of a ``--cell`` value (an alias too); a one-line error for an unknown one.

    >>> recipe("cnn")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --cell must be one of lstm, gru, rnn, mingru, ..., got 'cnn'
    """
    out = recipes().get(canonical(name))
    if out is None:
        raise GatelensError(f"--cell must be one of {', '.join(recipes())}, got {name!r}")
    return out


def keep_words(cell: str) -> str:
    """The keep gate of a ``--cell`` value in a reader's words, "" for none or unknown.

    >>> keep_words("gru"), keep_words("mingru-lm"), keep_words("rnn")
    ('GRU z', "mingru-pytorch's minGRU 1 − z", '')
    """
    r = recipes().get(canonical(cell))
    return r.keep_words if r is not None else ""


def check_build(r: Recipe, hidden: int, layers: int, heads: int) -> str | None:
    """The one-line reason a recipe cannot be built at this size, or None.

    >>> check_build(recipe("hf-mamba2"), 12, 1, 1)
    '--cell hf-mamba2: --hidden 12 must be a multiple of 8'
    """
    if heads != 1 and not r.takes("heads"):
        with_heads = [n for n, x in recipes().items() if x.takes("heads")]
        return f"--heads applies to --cell {', '.join(with_heads)} only, not {r.name}"
    step = r.size_multiple(heads)
    if hidden % step:
        if r.takes("heads") and not r.official:
            return f"--heads {heads} must divide --hidden {hidden}"
        return f"--cell {r.name}: --hidden {hidden} must be a multiple of {step}"
    return r.check(hidden, layers, heads) if r.check else None
