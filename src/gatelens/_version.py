"""The installed package's version, from its metadata (pyproject.toml is the one source)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    """gatelens's version string, e.g. '0.2.0'; '0+unknown' when run from a bare source tree.

    >>> version().count(".") >= 1 or version() == "0+unknown"
    True
    """
    try:
        return metadata.version("gatelens")
    except metadata.PackageNotFoundError:
        return "0+unknown"
