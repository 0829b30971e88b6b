"""The Lyapunov spectrum's cost rule (docs/methods.md "Cost at size"): how many exponents on
how many windows, said in one sentence when the rule, not the user, chose them.

>>> spectrum_plan("auto", 650, 32)
(64, 32, None)
"""

from __future__ import annotations

from gatelens.errors import GatelensError

__all__ = ["AUTO", "DEFAULT_K", "FRAME_BYTES", "SIZE_AT", "SIZE_WINDOWS", "TANGENT_BUDGET",
           "k_of", "spectrum_plan"]

DEFAULT_K = 64  # exponents by default (all of them when the state is smaller)
AUTO = "auto"  # the default: DEFAULT_K exponents, capped by the cost rule at size
SIZE_AT = 4096  # state dimensions above which the cost rule caps the spectrum's work
TANGENT_BUDGET = 64  # at size: k × windows, the tangent trajectories the spectrum pushes
SIZE_WINDOWS = 4  # at size: windows of the spectrum (each costs k tangent trajectories)
#: at size: the bytes of one window's frame of k tangent vectors (float64), of which the
#: spectrum holds about five at once (the frame, its image J_t Q as the JVPs give it and
#: joined, the two passes of its re-orthonormalisation: 1.2 GB above the stage's start for
#: a 222 MiB frame, measured): 24 Mamba-2 layers of mamba2-130m's width are 4.8M
#: dimensions, 39 MB a vector
FRAME_BYTES = 128 * 2**20


def spectrum_plan(k: int | str, size: int, windows: int) -> tuple[int, int, str | None]:
    """How many exponents on how many windows, and the cost rule's sentence (None: as asked).

    The spectrum pushes k tangent vectors through every step of each of its windows; one
    tangent vector's step is one JVP of the step, about the cost of the divergence rate's
    whole work on that window. Below ``SIZE_AT`` state dimensions the JVPs are batched
    cheaply and ``"auto"`` is ``DEFAULT_K`` on every window asked. Above it, ``"auto"``
    caps the work at ``TANGENT_BUDGET`` tangent trajectories: ``SIZE_WINDOWS`` windows of
    ``TANGENT_BUDGET // SIZE_WINDOWS`` exponents, and no more exponents than a frame of
    ``FRAME_BYTES`` holds. A count or ``"all"`` is taken as asked.

    >>> k, m, rule = spectrum_plan("auto", 58_368, 8)
    >>> k, m, rule[:60]
    (16, 4, 'the state has 58,368 dimensions (above 4,096): the spectrum ')
    >>> spectrum_plan(64, 58_368, 8)
    (64, 8, None)
    >>> k, m, rule = spectrum_plan("auto", 4_847_616, 2)  # 24 Mamba-2 layers
    >>> k, m, rule[-79:]
    (3, 2, 'as a frame of 3 tangent vectors is 111 MiB (--exponents N or all asks for more)')
    """
    if k != AUTO:
        return k_of(k, size), windows, None
    if size <= SIZE_AT:
        return min(DEFAULT_K, size), windows, None
    m = max(1, min(windows, SIZE_WINDOWS))
    kk = min(DEFAULT_K, size, max(1, TANGENT_BUDGET // m))
    fit = max(1, FRAME_BYTES // (8 * size))
    frame = ""
    if fit < kk:
        kk = fit
        frame = (f", as a frame of {kk} tangent vector{'s' * (kk > 1)} is "
                 f"{kk * size * 8 / 2**20:.0f} MiB")
    return kk, m, (f"the state has {size:,} dimensions (above {SIZE_AT:,}): the spectrum "
                   f"pushes at most {TANGENT_BUDGET} tangent trajectories, {kk} exponents "
                   f"on {m} windows{frame} (--exponents N or all asks for more)")


def k_of(k: int | str, size: int) -> int:
    """The exponents asked for (a count, ``"all"`` or ``AUTO``), at most ``size``."""
    if k == "all":
        return size
    if k == AUTO:
        return min(DEFAULT_K, size)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise GatelensError(f"the number of exponents must be a positive int or 'all'; got {k!r}")
    return min(k, size)
