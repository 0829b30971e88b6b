"""How a family builds its module for training: the ``--cell NAME`` recipe.

A family that can be trained (``gatelens train --cell NAME``) carries one ``Recipe`` as its
class attribute ``recipe``. Everything that training, the command line, studies and study
pages need to know about that kind of module is here, so none of them names a family:

- ``build`` makes the recurrent module at a width and depth (and the options in ``flags``);
- ``reads`` says how the language model around it feeds it: ``"features"`` (one-hot or
  embedded characters, the module returns ``(out, state)`` and carries its state: a
  ``CharLM``), ``"embedded"`` (embedded characters, the whole text each call: an official
  implementation's stack), ``"ids"`` (the module embeds the ids itself and returns its
  hidden states) or ``"lm"`` (the module is a whole language model: ids in, logits out);
- ``settings`` and ``package`` are an official implementation's fixed choices (config.json's
  model "official" block) and the package it needs, imported only when it is built;
- ``keep_init`` sets the keep gate's bias (``--forget-bias``, ``--chrono``);
- ``keep_words`` names the keep gate on study pages.

>>> r = Recipe("toy", "a toy cell", build=lambda n_in, hidden, layers, **_: None)
>>> r.takes("embed"), r.takes("heads"), r.size_multiple(4), r.official
(True, False, 1, False)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module, metadata

from torch import Tensor, nn

from gatelens.errors import GatelensError

#: the options a recipe may take, beyond --hidden and --layers
FLAGS = ("embed", "nonlinearity", "heads", "keep", "bias_init")
#: how the language model feeds the module (see the module docstring)
READS = ("features", "embedded", "ids", "lm")
#: the extra that brings the official implementations' packages
EXTRA = "pip install 'gatelens[modern]'"


@dataclass(frozen=True)
class Recipe:
    """One ``--cell`` value: how to build, feed, check and initialise the module.

    Attributes:
        name: the family's one name: ``--cell``, config.json's model "cell", the registry.
        help: one line for ``gatelens train --help``.
        build: ``build(n_in, hidden, layers, *, vocab_size, heads, nonlinearity,
            settings)`` -> the recurrent module (``n_in``: the input width, the vocabulary
            for one-hot input; ``settings``: ``self.settings`` with a run's overrides).
        reads: ``"features"``, ``"embedded"``, ``"ids"`` or ``"lm"`` (module docstring).
        flags: which of ``FLAGS`` apply (``keep``: ``--forget-bias`` and ``--chrono``).
        settings: an official implementation's fixed settings, recorded in config.json.
        package: (import name, PyPI name) of the package ``build`` needs, or None.
        multiple: ``multiple(heads)`` -> what ``--hidden`` must be a multiple of.
        check: ``check(hidden, layers, heads)`` -> the one-line reason it cannot be built
            so, or None.
        keep_init: ``keep_init(module, draw, chrono)`` sets the keep gate's bias of every
            layer (and direction), in order, to ``draw(units)`` (a float64 vector, one value
            per unit); ``chrono`` also sets the input gate to ``−draw`` where there is one.
        keep_words: the keep gate in a reader's words (study pages), "" for none.
        aliases: earlier ``--cell`` names still accepted for this one.
        forward: ``forward(module, x)`` -> its (B, T, d) output (or the logits of an
            ``"lm"``), for a module not called as ``module(x)``; None: ``module(x)``.
    """

    name: str
    help: str
    build: Callable[..., nn.Module]
    reads: str = "features"
    flags: frozenset[str] = frozenset({"embed", "bias_init"})
    settings: dict = field(default_factory=dict)
    package: tuple[str, str] | None = None
    multiple: Callable[[int], int] | None = None
    check: Callable[[int, int, int], str | None] | None = None
    keep_init: Callable[[nn.Module, Callable[[int], Tensor], bool], None] | None = None
    keep_words: str = ""
    aliases: tuple[str, ...] = ()
    forward: Callable[[nn.Module, Tensor], Tensor] | None = None

    def __post_init__(self) -> None:
        if self.reads not in READS:
            raise ValueError(f"Recipe {self.name!r}: reads must be one of {READS}, "
                             f"got {self.reads!r}")
        unknown = set(self.flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"Recipe {self.name!r}: unknown flags {sorted(unknown)}; "
                             f"expected some of {FLAGS}")
        if ("keep" in self.flags) != (self.keep_init is not None):
            raise ValueError(f"Recipe {self.name!r}: the 'keep' flag and keep_init go "
                             "together")

    @property
    def official(self) -> bool:
        """Read the whole text each call (an official implementation's module), rather
        than carrying its state between calls as a ``CharLM``'s module does."""
        return self.reads != "features"

    def run(self, module: nn.Module, x: Tensor) -> Tensor:
        """The module's whole-sequence output on ``x`` (an official implementation's)."""
        return module(x) if self.forward is None else self.forward(module, x)

    def takes(self, flag: str) -> bool:
        """Whether the option ``flag`` (one of ``FLAGS``) applies to this cell."""
        return flag in self.flags

    def size_multiple(self, heads: int = 1) -> int:
        """What ``--hidden`` must be a multiple of (``heads`` where the cell has heads)."""
        if self.multiple is not None:
            return self.multiple(heads)
        return heads if self.takes("heads") else 1

    def need(self):
        """The package ``build`` needs, imported; a one-line GatelensError naming the extra."""
        if self.package is None:
            return None
        name, pypi = self.package
        try:
            return import_module(name)
        except ImportError:
            raise GatelensError(f"--cell {self.name} needs the {pypi} package: {EXTRA}") \
                from None

    def official_block(self) -> dict:
        """config.json's model "official" record: the fixed settings and the package's
        version."""
        mod = self.need()
        pypi = self.package[1] if self.package else self.name
        version = getattr(mod, "__version__", None)
        if version is None and self.package:  # a package that does not say (rwkv 0.8.32)
            try:
                version = metadata.version(pypi)
            except metadata.PackageNotFoundError:
                version = None
        return {**self.settings, "package": f"{pypi} {version or 'unknown'}"}
