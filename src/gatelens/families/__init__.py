"""Families: everything gatelens needs to know about one kind of recurrent module.

The package is itself callable: ``gatelens.families()`` lists the registered families, each
with what it opens (``families/registry.py`` holds the list).

>>> import gatelens
>>> names = gatelens.families()
>>> names["lstm"], "mingru" in names
('nn.LSTM', True)
"""

from __future__ import annotations

import sys
import types


class _Families(types.ModuleType):
    """This package, callable: ``gatelens.families()``."""

    def __call__(self) -> dict[str, str]:
        """{family name: what it opens}, in the order modules are tried."""
        from gatelens.families.registry import family_classes

        return {cls.name: cls.opens_what for cls in family_classes()}


sys.modules[__name__].__class__ = _Families
