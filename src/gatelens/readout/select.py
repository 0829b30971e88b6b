"""Which recurrent modules and which trace names to read (``layers=``, ``names=``).

A deep model has one opened module per recurrent layer (a 24-layer Mamba: 24 mixers).
``layers`` picks some of them, by position among the opened modules in the model's order
(0, 3, -1) or by module path, exactly or as a shell pattern (``"backbone.layers.1?.mixer"``);
``names`` keeps only some trace names (``"s"``, ``"f"``, ``"layer0.c"`` as the last parts of
a key), so what is held is proportionally less. Nothing picked, or a pick that names nothing,
is one line listing what there is.

>>> paths = ["rnn", "dec.lstm", "dec.gru"]
>>> select_paths(paths, [0, "dec.g*"])
['rnn', 'dec.gru']
>>> select_paths(paths, [7])
Traceback (most recent call last):
...
gatelens.errors.GatelensError: layers: 7 is not one of the 3 recurrent modules (0..2, or -3..-1)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from gatelens.errors import GatelensError

__all__ = ["Selection", "as_flag", "count_or_list", "keeps_name", "layer_list", "select_paths"]

#: ``layers=``: positions among the opened modules, module paths or shell patterns
Selection = Iterable[int | str] | int | str | None


def _listed(paths: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(repr(p) for p in paths[:most])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > most else "")


def select_paths(paths: Sequence[str], layers: Selection) -> list[str]:
    """The paths ``layers`` picks, in the model's order (None: all of them)."""
    paths = list(paths)
    if layers is None:
        return paths
    picks = [layers] if isinstance(layers, int | str) else list(layers)
    if not picks:
        raise GatelensError(f"layers: an empty selection; the recurrent modules are "
                            f"{_listed(paths)}")
    chosen: set[str] = set()
    for pick in picks:
        if isinstance(pick, bool) or not isinstance(pick, int | str):
            raise GatelensError(f"layers: {pick!r} is neither a position nor a module path")
        if isinstance(pick, int):
            if not -len(paths) <= pick < len(paths):
                raise GatelensError(
                    f"layers: {pick} is not one of the {len(paths)} recurrent modules "
                    f"(0..{len(paths) - 1}, or -{len(paths)}..-1)")
            chosen.add(paths[pick])
            continue
        found = [p for p in paths if p == pick or fnmatchcase(p, pick)]
        if not found:
            raise GatelensError(f"layers: {pick!r} names no recurrent module; they are "
                                f"{_listed(paths)}")
        chosen.update(found)
    return [p for p in paths if p in chosen]


def layer_list(text: str) -> list[int | str]:
    """An argparse type for --modules (and --layers with --model): comma-separated
    positions or module paths/patterns.

    >>> layer_list("0,-1,model.layers.3.linear_attn")
    [0, -1, 'model.layers.3.linear_attn']
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected positions or module paths, got {text!r}")
    return [int(t) if t.lstrip("-").isdigit() else t for t in items]


def count_or_list(text: str) -> int | list[int | str]:
    """An argparse type for ``analyze --layers``: how many layers (a positive integer, with
    ``--weights``) or which recurrent modules (``layer_list``, with ``--model``).

    >>> count_or_list("2"), count_or_list("0"), count_or_list("-1,x")
    (2, [0], [-1, 'x'])
    """
    picks = layer_list(text)
    one = picks[0] if len(picks) == 1 else None
    return one if isinstance(one, int) and one > 0 else picks


def as_flag(error: GatelensError, flag: str) -> GatelensError:
    """``select_paths``'s error as a command line says it: naming ``flag`` instead of the
    Python argument ``layers`` (any other error as it is).

    >>> str(as_flag(GatelensError("layers: 7 is not one of ..."), "--modules"))
    '--modules: 7 is not one of ...'
    """
    text = str(error)
    return GatelensError(flag + text[len("layers"):]) if text.startswith("layers: ") else error


def keeps_name(key: str, names: Sequence[str] | None) -> bool:
    """Whether a trace key (``layer0.f``, ``layer1.reverse.c``) is one ``names`` keeps:
    a name equal to the key or to its last dot-separated parts.

    >>> keeps_name("layer1.reverse.c", ["c"]), keeps_name("layer1.c", ["layer0.c"])
    (True, False)
    """
    if names is None:
        return True
    return any(key == n or key.endswith("." + n) for n in names)
