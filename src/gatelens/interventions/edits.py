"""The edits ``Lens.run`` applies: Set, Add, Scale, Zero, Mean and Patch (docs/interventions.md).

Each names a trace key as ``open_cells`` keys it (module path + trace name:
``"lstm.layer0.f"``; a module that is the model has the bare name ``"layer0.f"``), the
window positions ``at`` (one position, or a slice of them), optionally ``units`` (unit,
head or channel indices of that signal; None: all), and whether the edit carries forward
(``carry=True``, the default: the edited value is used inside the step, so the state
every later step receives is the edited run's) or is "this position only" (``carry=False``:
what position t puts out changes, the state handed to step t + 1 is the unedited one).

A value is a number or a tensor broadcastable to the edited slice: (B, U) for one
position, (B, n, U) for a slice of n positions (U = the number of edited units).

>>> e = Set("lstm.layer0.f", 1.0, at=slice(32, None), units=[5, 17])
>>> e, e.op
(Set('lstm.layer0.f', at=slice(32, None, None), units=[5, 17]), 'set')
>>> Zero("layer0.c", at=4).op, Scale("layer0.h", 0.5, at=2).op
('set', 'scale')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

__all__ = ["Add", "Edit", "Mean", "Patch", "Scale", "Set", "Zero"]

#: a window position or a slice of positions
At = int | slice


class Edit:
    """What every edit has: ``name``, ``at``, ``units``, ``carry``; ``op`` says how its
    value meets the computed one ("set", "add" or "scale")."""

    op: ClassVar[str] = "set"
    name: str
    at: At
    units: Sequence[int] | None
    carry: bool

    def __repr__(self) -> str:
        units = "" if self.units is None else f", units={list(self.units)}"
        carry = "" if self.carry else ", carry=False"
        return f"{type(self).__name__}({self.name!r}, at={self.at!r}{units}{carry})"


@dataclass(frozen=True, eq=False, repr=False)
class Valued(Edit):
    """An edit that carries a value (Set, Add, Scale): a number or a tensor."""

    name: str
    value: float | Tensor
    at: At
    units: Sequence[int] | None = None
    carry: bool = True


@dataclass(frozen=True, eq=False, repr=False)
class Set(Valued):
    """The value replaces the computed one."""


@dataclass(frozen=True, eq=False, repr=False)
class Add(Valued):
    """The value is added to the computed one (steering: a vector added to a state)."""

    op: ClassVar[str] = "add"


@dataclass(frozen=True, eq=False, repr=False)
class Scale(Valued):
    """The computed value is multiplied by the value."""

    op: ClassVar[str] = "scale"


@dataclass(frozen=True, eq=False, repr=False)
class Zero(Edit):
    """Zero-ablation: the value is replaced by 0."""

    name: str
    at: At
    units: Sequence[int] | None = None
    carry: bool = True


@dataclass(frozen=True, eq=False, repr=False)
class Mean(Edit):
    """Mean-ablation: the value is replaced by its mean, per unit, over the windows and
    positions of the unedited run on ``over`` (ids (B', T'); None: the ids being run)."""

    name: str
    at: At
    units: Sequence[int] | None = None
    carry: bool = True
    over: Tensor | None = None


@dataclass(frozen=True, eq=False, repr=False)
class Patch(Edit):
    """Interchange: the value is the one the same key took, at the same positions, in the
    unedited run on ``source`` (ids (B or 1, T'), T' past the last edited position)."""

    name: str
    source: Tensor
    at: At
    units: Sequence[int] | None = None
    carry: bool = True
