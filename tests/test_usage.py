"""Usage errors that used to be tracebacks, hangs or wrong messages: each a one-line error,
exit 2, nothing written."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import gatelens.io as gio
from gatelens.cli import main
from gatelens.training.runs import read_config

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import SMALL, one_line  # noqa: E402

TEXT = "\n".join(" ".join(("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
                             "dog")[(i * 7 + k) % 9] for k in range(8)) for i in range(300))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("usage")
    (d / "tiny.txt").write_text(TEXT, encoding="utf-8")
    assert main(["train", "--corpus", str(d / "tiny.txt"), *SMALL, "--out", str(d / "run")]) == 0
    return d / "run"


@pytest.mark.parametrize("tol, says", [("-1", "zero or positive"), ("nan", "finite"),
                                       ("inf", "finite"), ("x", "expected a number")])
def test_verify_tolerance_is_checked(capsys, run, tol, says):
    line = one_line(capsys, ["verify", run, "--tol", tol])
    assert "--tol" in line and says in line


def test_sample_seed_and_temperature_are_checked(capsys, run):
    assert "--seed" in one_line(capsys, ["sample", run, "--seed", str(2**70)])
    assert "--temperature" in one_line(capsys, ["sample", run, "--temperature", "inf"])
    assert main(["sample", str(run), "--seed", str(-2**63), "--length", "3"]) == 0


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "too big"])
def test_special_files_are_refused_before_they_are_read(capsys, run, tmp_path, fifo,
                                                        monkeypatch, kind):
    big = tmp_path / "big.txt"
    big.write_text("ab" * 600)
    path = {"device": "/dev/zero", "fifo": fifo, "directory": tmp_path, "too big": big}[kind]
    says = {"device": "not a regular file", "fifo": "not a regular file",
            "directory": "is a directory", "too big": "above gatelens's limit of 1 KiB"}[kind]
    monkeypatch.setattr(gio, "TEXT_CAP", 1024)
    out = tmp_path / "new"
    for argv in (["train", "--corpus", path, *SMALL, "--out", out],
                 ["analyze", run, "--text", path, "--out", out],
                 ["verify", run, "--text", path],
                 ["analyze", "--weights", run / "model.safetensors", "--vocab", path, "--text",
                  run.parent / "tiny.txt", "--out", out]):
        line = one_line(capsys, argv)
        assert f"{path}: " in line and says in line, line
    assert not out.exists()


def test_one_distinct_character_says_so(capsys, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a" * 400)
    line = one_line(capsys, ["train", "--corpus", one, *SMALL, "--out", tmp_path / "r"])
    assert "one distinct character ('a'); a language model needs at least two" in line
    assert "--prime" not in line and not (tmp_path / "r").exists()


def test_sample_without_prime_on_a_corpus_without_newlines(capsys, tmp_path):
    text = tmp_path / "ab.txt"
    text.write_text("abba baab " * 60)
    assert main(["train", "--corpus", str(text), *SMALL, "--out", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "r"), "--length", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" ")  # the vocabulary's first character, " " < "a" < "b"
    assert "--prime" in one_line(capsys, ["sample", tmp_path / "r", "--prime", "\n"])


def test_resume_below_the_steps_done_is_refused_and_the_run_untouched(capsys, run):
    before = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    line = one_line(capsys, ["train", "--resume", "--steps", "2", "--out", run])
    assert "--steps 2 is below the 4 steps this run has done" in line
    assert {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    assert read_config(run)["steps_done"] == 4
