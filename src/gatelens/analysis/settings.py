"""The analysis settings: one frozen object, its defaults documented once and validated once.

Every entry point (the command line, ``Lens.analyze``, ``Lens.measure``, ``analyze``,
``analyze_foreign``, ``measure``, studies, ``reproduce``) takes an ``AnalysisSettings``
(``settings=``) or the same names as keyword arguments, the public convenience; both are
turned into one object here, by ``AnalysisSettings.build``, and nothing downstream reads a
loose keyword again.

>>> DEFAULTS.windows, DEFAULTS.length, DEFAULTS.perturb_pos, DEFAULTS.exponents
(32, 128, 32, 'auto')
>>> AnalysisSettings.build(None, length=24, perturb_pos=4).perturb_pos
4
>>> try:
...     AnalysisSettings.build(None, lenght=24)
... except GatelensError as e:
...     print(e)  # doctest: +NORMALIZE_WHITESPACE
unknown analysis setting 'lenght' (the settings are windows, length, perturb_pos, exponents,
fixed_points, memory_windows, seed)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from gatelens.errors import SEED_MAX, GatelensError

ALL = "all"  # windows="all": every whole window; exponents="all": the whole spectrum
AUTO = "auto"  # exponents="auto": 64, capped at size by the spectrum's cost rule


@dataclass(frozen=True)
class AnalysisSettings:
    """What an analysis reads and measures (docs/methods.md).

    windows: B, the number of windows (the seed's 32); "all": every whole window.
    length: T, tokens (characters for a character model) per window (the seed's 128).
    perturb_pos: p, the position of the replaced token (the seed's 32); lag 1 must fit.
    exponents: the k largest Lyapunov exponents, "all", 0 for none, or "auto" (the
        default): 64, and above 4,096 state dimensions the cost rule's k and windows
        (``spectrum_plan``; docs/methods.md "Cost at size").
    fixed_points: also search fixed points under held inputs (slow).
    memory_windows: windows of the spectrum and the context used (0: neither).
    seed: draws the replacement tokens and the spectrum's start vectors; None: the run's
        own seed for a run's model, else 0.
    """

    windows: int | str = 32
    length: int = 128
    perturb_pos: int = 32
    exponents: int | str = AUTO
    fixed_points: bool = False
    memory_windows: int = 32
    seed: int | None = None

    def __post_init__(self) -> None:
        _count("windows", self.windows, allow_all=True)
        _count("length", self.length)
        if self.length < 2:
            raise GatelensError(f"length {self.length}: a window needs at least 2 positions")
        if isinstance(self.perturb_pos, int) and self.perturb_pos < 0:  # the unit is not
            # known here (characters, tokens, bytes); against T: in measure
            raise GatelensError(f"--perturb-pos {self.perturb_pos} leaves no lag: a position "
                                f"is 0 or more, and at most the window's length − 2")
        _count("perturb_pos", self.perturb_pos, minimum=0)
        if self.exponents != AUTO:
            _count("exponents", self.exponents, minimum=0, allow_all=True)
        if not isinstance(self.fixed_points, bool):
            raise GatelensError(f"fixed_points must be True or False; got {self.fixed_points!r}")
        _count("memory_windows", self.memory_windows, minimum=0)
        if self.seed is not None:
            _count("seed", self.seed, minimum=0)
            if self.seed > SEED_MAX:  # what torch.Generator.manual_seed takes
                raise GatelensError(f"seed must be at most 2**64 - 1; got {self.seed}")

    @classmethod
    def build(cls, settings: AnalysisSettings | None = None,
              **options: object) -> AnalysisSettings:
        """``settings`` (default: ``DEFAULTS``) with ``options`` replacing its fields; an
        option that is not a setting is a one-line GatelensError naming it."""
        base = DEFAULTS if settings is None else settings
        if not isinstance(base, AnalysisSettings):
            raise GatelensError(f"settings must be an AnalysisSettings; got "
                                f"{type(base).__name__}")
        names = [f.name for f in fields(cls)]
        for key in options:
            if key not in names:
                raise GatelensError(f"unknown analysis setting {key!r} (the settings are "
                                    f"{', '.join(names)})")
        return replace(base, **options) if options else base

    def seed_or(self, default: int) -> int:
        """The seed, or ``default`` (a run's own seed, else 0) when none was given."""
        return default if self.seed is None else self.seed

    def to_dict(self) -> dict:
        return asdict(self)


def check_perturb_pos(position: int, length: int, unit: str = "characters") -> None:
    """A perturbation position must leave at least lag 1 inside the window; ``unit``: what a
    position is (characters, tokens, bytes: ``Lens.unit``).

    >>> check_perturb_pos(9, 10)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --perturb-pos 9 leaves no lag in windows of 10 characters (0..8)
    >>> check_perturb_pos(16, 16, "tokens")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --perturb-pos 16 leaves no lag in windows of 16 tokens (0..14)
    """
    if position < 0 or position + 1 >= length:
        raise GatelensError(f"--perturb-pos {position} leaves no lag in windows of {length} "
                            f"{unit} (0..{length - 2})")


def _count(name: str, value: object, *, minimum: int = 1, allow_all: bool = False) -> None:
    """An integer setting at least ``minimum`` (or "all" where allowed), else one line."""
    if allow_all and value == ALL:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        also = ' or "all"' if allow_all else ""
        raise GatelensError(f"{name} must be an integer >= {minimum}{also}; got {value!r}")


DEFAULTS = AnalysisSettings()
