"""Shared fixtures: small texts the tests make themselves (no network, no downloads)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = ("the quick brown fox jumps over a lazy dog and then runs home to sleep "
         "while it rains").split()


def make_text(n_lines: int = 400, seed: int = 1) -> str:
    """A learnable text: short lines of common words, spaces and newlines."""
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n_lines))


@pytest.fixture
def tiny_text(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(make_text(), encoding="utf-8")
    return path
