"""Edits resolved against the model: which module and trace name each one names, its
positions, units and values, as the ``StepChange`` rows a family's step applies.

Everything a user can get wrong is a one-line GatelensError naming the edit: an unknown
key (the valid keys listed), a position outside the window, units outside the signal's
width, a value that does not broadcast to the edited slice, a Patch source of another
batch size or too short.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gatelens.errors import GatelensError
from gatelens.families.edit_plan import EditPlan, StepChange
from gatelens.interventions.edits import Edit, Mean, Patch, Valued, Zero


def positions(edit: Edit, T: int, where: str) -> list[int]:
    """The window positions ``edit.at`` names among T (an int, negative from the end, or a
    slice), sorted; GatelensError when outside or empty.

    >>> positions(Zero("layer0.h", at=slice(2, None)), 5, "layer0.h")
    [2, 3, 4]
    """
    at = edit.at
    if isinstance(at, bool) or not isinstance(at, (int, slice)):
        raise GatelensError(f"{edit!r}: at must be a position (int) or a slice of positions; "
                            f"got {type(at).__name__}")
    if isinstance(at, int):
        if not -T <= at < T:
            raise GatelensError(f"{edit!r}: position {at} is outside the {T} positions of "
                                f"{where} (0..{T - 1})")
        return [at % T]
    out = sorted(range(T)[at])
    if not out:
        raise GatelensError(f"{edit!r}: {at!r} names no position of the {T} of {where}")
    return out


def check_units(edit: Edit) -> list[int] | None:
    """``edit.units`` as a list of distinct non-negative ints (None: every unit)."""
    units = edit.units
    if units is None:
        return None
    if isinstance(units, Tensor):
        units = units.tolist()
    if isinstance(units, (int, str)) or not isinstance(units, Sequence) or not units or any(
            isinstance(u, bool) or not isinstance(u, int) or u < 0 for u in units):
        raise GatelensError(f"{edit!r}: units must be a non-empty list of unit indices >= 0; "
                            f"got {units!r}")
    if len(set(units)) != len(units):
        raise GatelensError(f"{edit!r}: units {list(units)} repeat an index")
    return list(units)


@dataclass
class Resolved:
    """One edit bound to its module (``path``) and trace name (``trace``: ``layer0.f``).
    ``clean``: the unedited run's value of the key (B', T', W) where the edit needs one
    (Mean: on its ``over``; Patch: on its ``source``)."""

    edit: Edit
    path: str
    trace: str
    units: list[int] | None
    clean: Tensor | None = None
    applied: set[int] = field(default_factory=set)  # positions the edit was applied at
    expected: set[int] = field(default_factory=set)  # positions it names, on every call
    _cache: dict = field(default_factory=dict)

    @property
    def layer(self) -> str:
        return self.trace.rpartition(".")[0]

    @property
    def letter(self) -> str:
        return self.trace.rpartition(".")[2]

    def change(self, T: int, where: str) -> StepChange:
        """This edit as a family applies it, on a call whose window has T positions."""
        pos = positions(self.edit, T, where)
        if isinstance(self.edit, Patch) and self.clean is not None:
            if self.clean.shape[1] <= pos[-1]:
                raise GatelensError(f"{self.edit!r}: the source has {self.clean.shape[1]} "
                                    f"positions; the edit reaches position {pos[-1]}")
        index = {t: j for j, t in enumerate(pos)}
        self.expected.update(pos)

        def apply(t: int, value: Tensor) -> Tensor:
            self.applied.add(t)
            return self._apply(index[t], pos, value)

        return StepChange(self.layer, self.letter, frozenset(pos), self.edit.carry, apply)

    def _values(self, pos: list[int], B: int, U: int, like: Tensor) -> Tensor:
        """The edit's values for every position, (B, n, U), broadcast (cached)."""
        key = (B, U, like.dtype, like.device)
        if key in self._cache:
            return self._cache[key]
        e, n, units = self.edit, len(pos), self.units
        if isinstance(e, Zero):
            v: Tensor = like.new_zeros(())
        elif isinstance(e, Mean):
            m = self.clean.reshape(-1, self.clean.shape[-1]).double().mean(0).to(like.dtype)
            v = m if units is None else m[units]  # (U,)
        elif isinstance(e, Patch):
            src = self.clean[:, pos]  # (B', n, W)
            v = src if units is None else src[..., units]
            if v.shape[0] not in (1, B):
                raise GatelensError(f"{e!r}: the source has {v.shape[0]} sequences; the run "
                                    f"has {B} (give {B} or 1)")
        else:
            v = torch.as_tensor(e.value)
        v = v.to(dtype=like.dtype, device=like.device)
        want = (B, U) if isinstance(e.at, int) and not isinstance(e, Patch) else (B, n, U)
        try:
            out = torch.broadcast_to(v, want)
        except RuntimeError:
            raise GatelensError(f"{e!r}: a value of shape {tuple(v.shape)} does not broadcast "
                                f"to the edited slice {want} (batch, "
                                f"{'' if len(want) == 2 else 'positions, '}units)") from None
        out = out.unsqueeze(1) if len(want) == 2 else out
        self._cache[key] = out
        return out

    def _apply(self, j: int, pos: list[int], value: Tensor) -> Tensor:
        """``value`` (B, W) as the edit leaves it at its j-th position."""
        B, W = value.shape[0], value.shape[-1]
        if self.units is not None and max(self.units) >= W:
            bad = [u for u in self.units if u >= W]
            raise GatelensError(f"{self.edit!r}: units {bad} are outside the {W} units of "
                                f"{self.trace} (0..{W - 1})")
        U = W if self.units is None else len(self.units)
        v = self._values(pos, B, U, value)[:, j]  # (B, U)
        old = value if self.units is None else value[:, self.units]
        new = v if self.edit.op == "set" else (old + v if self.edit.op == "add" else old * v)
        if self.units is None:
            return new.clone()
        out = value.clone()
        out[:, self.units] = new
        return out


def resolve(edits: Sequence[Edit], keys: Mapping[str, tuple[str, str]],
            clean: Callable[[Tensor], Mapping[str, Tensor]], ids: Tensor) -> list[Resolved]:
    """Each edit bound to its module and trace name. ``keys``: every trace key ->
    (module path, trace name); ``clean(ids)``: the unedited run's trace on ids, keyed the
    same (called once per distinct input, only for Mean and Patch)."""
    out, runs = [], {}
    for e in edits:
        if not isinstance(e, Edit):
            raise GatelensError(f"edits must be gatelens.Set, Add, Scale, Zero, Mean or Patch; "
                                f"got {type(e).__name__}")
        if not isinstance(e.name, str) or e.name not in keys:
            raise GatelensError(f"{e!r}: no trace key {e.name!r}; the model's keys are "
                                f"{', '.join(keys)}")
        if isinstance(e, Valued) and not isinstance(e.value, (int, float, Tensor)):
            raise GatelensError(f"{e!r}: value must be a number or a tensor; got "
                                f"{type(e.value).__name__}")
        path, trace = keys[e.name]
        r = Resolved(e, path, trace, check_units(e))
        src = e.source if isinstance(e, Patch) else (
            (ids if e.over is None else e.over) if isinstance(e, Mean) else None)
        if src is not None:
            if not isinstance(src, Tensor) or src.ndim != 2 or src.dtype != torch.long:
                raise GatelensError(f"{e!r}: its ids must be a (B, T) int64 tensor; got "
                                    f"{getattr(src, 'dtype', type(src).__name__)}")
            if id(src) not in runs:
                runs[id(src)] = clean(src)
            if e.name not in runs[id(src)]:
                raise GatelensError(f"{e!r}: the unedited run on its ids did not run "
                                    f"{e.name!r}")
            r.clean = runs[id(src)][e.name]
        out.append(r)
    return out


def plan_of(resolved: Sequence[Resolved], path: str, T: int, where: str,
            grad: bool = False, signals: bool = True) -> EditPlan:
    """The plan of one call of the module at ``path`` (T window positions); ``grad``: run
    it with autograd on; ``signals`` False: the output alone is wanted."""
    return EditPlan((r.change(T, where) for r in resolved if r.path == path), grad=grad,
                    signals=signals)
