"""Atomic writes: a failed write leaves the old file whole and no temporary behind."""

from __future__ import annotations

import pytest

from gatelens.io import atomic_write, atomic_write_json


def test_failed_write_keeps_old_file(tmp_path):
    p = tmp_path / "config.json"
    atomic_write_json(p, {"a": 1})

    def half(tmp):
        tmp.write_text('{"a": ')
        raise OSError("disk full")
    with pytest.raises(OSError):
        atomic_write(p, half)
    assert p.read_text() == '{\n  "a": 1\n}\n'
    assert [x.name for x in tmp_path.iterdir()] == ["config.json"]


def test_json_refuses_nan(tmp_path):
    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "x.json", {"a": float("nan")})
    assert not (tmp_path / "x.json").exists()
