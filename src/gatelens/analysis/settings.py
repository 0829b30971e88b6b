"""The analysis settings and their defaults, in one place: every entry point (the command
line, ``Lens``, ``analyze``, ``measure``, studies, ``reproduce``) reads them here.

>>> DEFAULTS.windows, DEFAULTS.length, DEFAULTS.perturb_pos, DEFAULTS.exponents
(32, 128, 32, 64)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AnalysisSettings:
    """What an analysis reads and measures (docs/methods.md)."""

    windows: int | str = 32  # B, windows (the seed's 32); "all": every whole window
    length: int = 128  # T, characters per window (the seed's 128)
    perturb_pos: int = 32  # p, the position of the changed character (the seed's 32)
    exponents: int | str = 64  # Lyapunov exponents: the k largest, "all", or 0 (none)
    fixed_points: bool = False  # search fixed points under held inputs (slow)
    memory_windows: int = 32  # windows of the spectrum and the context used (0: neither)

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULTS = AnalysisSettings()
