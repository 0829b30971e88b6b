"""The name of a layer and direction, the prefix of every trace name (``layer0.f``,
``layer1.reverse.h``): public API, spelled here only.
"""

from __future__ import annotations


def layer_name(layer: int, reverse: bool = False) -> str:
    """The name of one layer and direction: the prefix of its trace names.

    >>> layer_name(0), layer_name(1, reverse=True)
    ('layer0', 'layer1.reverse')
    """
    return f"layer{layer}{'.reverse' if reverse else ''}"


def layer_names(num_layers: int, bidirectional: bool = False) -> list[str]:
    """Every layer and direction, in trace order.

    >>> layer_names(2, bidirectional=True)
    ['layer0', 'layer0.reverse', 'layer1', 'layer1.reverse']
    """
    dirs = (False, True) if bidirectional else (False,)
    return [layer_name(k, r) for k in range(num_layers) for r in dirs]
