"""What a family sees of an intervention: which signals of which layer change at which
window positions, and a function that edits a value inside a step.

``gatelens.interventions`` turns the user's edits (Set, Add, Scale, Zero, Mean, Patch) into
one ``EditPlan`` per call of a module; a family's ``intervene`` (families/base.py) steps its
cell at the plan's positions with ``plan.step_edit(layer, t)`` inside the step (the cell's
own equations carry a gate edit into the state) and runs the module's own kernel
everywhere else. Positions are window positions t (the state at t is the state after step
t), whatever order a direction processes them in.

>>> import torch
>>> ch = StepChange("layer0", "f", frozenset({2}), carry=True,
...                 apply=lambda t, v: torch.ones_like(v))
>>> plan = EditPlan([ch])
>>> plan.positions("layer0"), plan.local("layer0", 2)
([2], False)
>>> plan.step_edit("layer0", 2)("f", torch.zeros(1, 3)).tolist()
[[1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from gatelens.cells.equations import StepEdit
from gatelens.cells.names import layer_name

#: the write of an official family's step into its state, e_t = s_t − A_t(s_{t−1}): a
#: letter a plan may edit besides the trace's (families/official_edit.py)
ENTRY = "entry"


@dataclass(frozen=True)
class StepChange:
    """One edit of one signal (``letter``) of one layer and direction (``layer``, e.g.
    ``layer1.reverse``) at window ``positions``. ``apply(t, value)`` returns the edited
    value (B, W) from the one the step computed; ``carry`` False: the state handed to the
    next step is the unedited one ("this position only")."""

    layer: str
    letter: str
    positions: frozenset[int]
    carry: bool
    apply: Callable[[int, Tensor], Tensor]


class EditPlan:
    """The changes of one call of one module, by layer. ``grad``: the family runs the
    edited call with autograd on (attribution patching differentiates through it); else
    under no_grad. ``signals`` False: only the output is wanted, a family may skip reading
    the signals of its unedited stretches (and return fewer). ``known``: the caller has
    the unedited run's signals of this call, so a family may give its signals from the
    first edited position on only ((B, T − first, ·) each). ``start``: the unedited run's
    signals of this call (trace name -> (B, T, ·)), from which a family may take its state
    before the first edit instead of running its prefix (a patching sweep's runs; None:
    run it). ``keep``: the only trace names the caller reads (None: every one); a family
    may leave the others out (the return path cut reads the states alone: at 24 layers of
    mamba-130m's width the other signals of the cut run were 0.6 GB). ``output`` False:
    the caller reads the signals it keeps and not the module's output, so a family may stop
    after the last layer it keeps and return None for the output (a return path cut's
    group of low layers runs those layers only)."""

    def __init__(self, changes: Iterable[StepChange], grad: bool = False,
                 signals: bool = True, known: bool = False,
                 start: Mapping[str, Tensor] | None = None,
                 keep: Iterable[str] | None = None, output: bool = True) -> None:
        if not (output or signals):
            raise ValueError("an edited run that gives neither its output nor its signals")
        self.output = output
        self.changes = list(changes)
        self.grad = grad
        self.signals = signals
        self.known = known
        self.start = start
        self.keep = None if keep is None else frozenset(keep)

    def wants(self, name: str) -> bool:
        """Whether the caller reads the trace name ``name`` of the edited run."""
        return self.signals and (self.keep is None or name in self.keep)

    def through(self, fam: Any) -> int:
        """How many of ``fam``'s layers, from the bottom, the edited run must go through:
        every one when it gives the module's output, else up to the last layer it keeps a
        signal of (``output`` False)."""
        L = fam.num_layers
        if self.output:
            return L
        return max((k + 1 for k in range(L) for g in fam.letters(k)
                    if self.wants(f"{layer_name(k)}.{g}")), default=0)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def layers(self) -> set[str]:
        """The layers (and directions) something changes in."""
        return {c.layer for c in self.changes}

    def positions(self, layer: str) -> list[int]:
        """The window positions at which ``layer`` has an edit, sorted."""
        return sorted({t for c in self.changes if c.layer == layer for t in c.positions})

    def local(self, layer: str, t: int) -> bool:
        """Whether an edit of ``layer`` at ``t`` is "this position only" (carry=False)."""
        return any(not c.carry and t in c.positions for c in self.changes if c.layer == layer)

    def step_edit(self, layer: str, t: int, carried_only: bool = False) -> StepEdit:
        """The edit inside step ``t`` of ``layer``: every change there (``carried_only``:
        only those that carry forward, for the state handed to step t + 1)."""
        here = [c for c in self.changes if c.layer == layer and t in c.positions
                and (c.carry or not carried_only)]

        def edit(letter: str, value: Tensor) -> Tensor:
            for c in here:
                if c.letter == letter:
                    value = c.apply(t, value)
            return value

        return edit
