"""Interventions for the official families whose hand cell takes ``edit=`` inside its step
(Gated DeltaNet, KDA, RG-LRU, xLSTM): the module's own run before the first edited
position, bitwise, and the hand cell with the edit inside the step from there
(families/official_edit.py ``intervene``). A mixin, so that each family file stays short.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gatelens.families.base import Call

__all__ = ["StepEdits", "no_edit"]


def no_edit(letter: str, value: Tensor) -> Tensor:
    """The edit of an unedited step: every value as computed."""
    return value


class StepEdits:
    """``intervene`` through families/official_edit.py for a family whose ``step_cell``
    takes ``edit=`` and whose ``_forward(call)`` is the module's own forward."""

    def own_output(self, call: Call) -> Any:
        """What the module returns for the call, with no cache."""
        return self._forward(call)  # type: ignore[attr-defined]

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0
                  ) -> tuple[Any, dict[str, Tensor]]:
        """Edits inside the hand cell's steps from the first edited position on; the
        module's own run before it."""
        from gatelens.families.official_edit import intervene

        return intervene(self, call, plan, output, offset)
