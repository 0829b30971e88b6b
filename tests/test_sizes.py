"""Sizes a careless or hostile user gives: huge, zero or negative, through the command line,
a study spec and Lens. Each is one line naming the setting before any work (exit 2), never
a C++ stack, a loop building 2**70 layers, a Ray traceback or a machine out of memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gatelens
from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.training.fits import (
    MAX_LAYERS,
    MAX_UNITS,
    memory_bytes,
    size_words,
    training_bytes,
)

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import SMALL, one_line  # noqa: E402

HUGE = str(2**62)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("flag, says", [
    ("--hidden", f"--hidden must be at most {MAX_UNITS}, got {HUGE}"),
    ("--embed", f"--embed must be at most {MAX_UNITS}, got {HUGE}"),
    ("--layers", f"--layers must be at most {MAX_LAYERS}, got {HUGE}"),
    ("--batch", f"--batch {HUGE} --seq 16: training needs at least "),
])
def test_train_sizes_beyond_any_model_are_one_line(capsys, tiny_text, tmp_path, flag, says):
    """Before: --hidden/--embed/--batch 2**62 a traceback (a C++ stack), --layers 2**62
    modules built until the machine gave out."""
    line = one_line(capsys, ["train", "--corpus", tiny_text, *SMALL, flag, HUGE,
                             "--out", tmp_path / "r"])
    assert says in line, line
    assert not (tmp_path / "r").exists()


def test_training_that_cannot_fit_in_memory_is_refused_before_the_model_exists(
        capsys, tiny_text, tmp_path, monkeypatch):
    """The memory rule is a lower bound (weights, gradients, Adam's two moments, one batch):
    only what cannot possibly fit is refused, and the model is never allocated."""
    import gatelens.training.fits as fits
    import gatelens.training.train as train

    vocab = len(set(tiny_text.read_text()))
    params = 4 * (8 * vocab + 8 * 8 + 2 * 8) + 8 * vocab + vocab  # the LSTM and its head
    needs = training_bytes(params, batch=4, seq=16, width_in=vocab, hidden=8, layers=1,
                           vocab=vocab, optimizer="adam")
    assert needs == 4 * (4 * params + 4 * 16 * (vocab + 8 + vocab))
    monkeypatch.setattr(fits, "memory_bytes", lambda: needs - 1)  # a machine one byte short
    monkeypatch.setattr(train, "build", lambda *a: pytest.fail("the model was built"))
    line = one_line(capsys, ["train", "--corpus", tiny_text, *SMALL, "--out", tmp_path / "r"])
    assert f"({params:,} parameters with their gradients and adam's state" in line
    assert line.endswith(f"more than this machine's {size_words(needs - 1)} of memory")
    assert not (tmp_path / "r").exists()
    assert memory_bytes() > 2**20  # the real machine: a number, the cgroup's where lower


def test_a_study_of_trials_that_cannot_fit_is_refused_before_ray(tmp_path, tiny_text,
                                                                monkeypatch):
    import gatelens.studies.study as study
    from gatelens.studies.spec import parse_spec

    monkeypatch.setattr(study, "_import_ray", lambda: pytest.fail("Ray was started"))
    spec = parse_spec({"grid": {"seed": [0], "hidden": [8, 60_000]},
                       "train": {"corpus": str(tiny_text), "steps": 2}})
    with pytest.raises(GatelensError, match=r"^trial hidden-60000_seed-0: --hidden 60000 "
                                            r"--layers 1 --batch 32 --seq 128: training needs"):
        study.run_study(spec, tmp_path / "s", progress=False)
    with pytest.raises(GatelensError, match=r"^SPEC: trial seed-0: --hidden must be at most"):
        parse_spec({"grid": {"seed": [0]}, "train": {"corpus": str(tiny_text),
                                                     "hidden": 2**70}})


def test_more_workers_than_trials_start_no_more(tmp_path, tiny_text, monkeypatch):
    """--workers 2**62 was handed to ray.init as CPUs: Ray's ValueError, 40 lines."""
    import gatelens.studies.study as study
    from gatelens.studies.spec import parse_spec
    from gatelens.studies.trial import new_record

    seen = {}

    def run_ray(todo, out, **kw):
        seen.update(kw)
        return [{**new_record(t), "status": "failed", "error": "not run"} for t in todo]
    monkeypatch.setattr(study, "_import_ray", lambda: None)
    monkeypatch.setattr(study, "run_ray", run_ray)
    spec = parse_spec({"grid": {"seed": [0, 1]}, "train": {"corpus": str(tiny_text),
                                                            "hidden": 4, "steps": 2}})
    study.run_study(spec, tmp_path / "s", workers=2**62, progress=False)
    assert seen["workers"] == 2


def test_lens_seed_beyond_what_torch_seeds_from(tmp_path):
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    lens = gatelens.Lens(lstm, vocab=3, encode=lambda i: torch.nn.functional.one_hot(
        i, 3).float())
    with pytest.raises(GatelensError, match=r"^seed must be at most 2\*\*64 - 1; got 1844"):
        lens.analyze(torch.zeros(2, 8, dtype=torch.long), perturb_pos=2, seed=2**64)


def test_sample_streams_any_length_in_pieces(capsys, tiny_text, tmp_path, monkeypatch):
    """--length 2**62 held every drawn id in a list until the machine ran out; the text now
    comes in pieces of CHUNK characters, written as they come."""
    import gatelens.training.sample as sample
    from gatelens.training.runs import load_run

    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(tmp_path / "r")]) \
        == 0
    monkeypatch.setattr(sample, "CHUNK", 7)
    run = load_run(tmp_path / "r")
    pieces = list(sample.sample_chunks(run, 30, prime="the"))
    assert pieces[0] == "the" and [len(p) for p in pieces[1:]] == [7, 7, 7, 7, 2]
    assert "".join(pieces) == sample.sample(run, 30, prime="the")
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "r"), "--length", "30", "--prime", "the"]) == 0
    assert capsys.readouterr().out == "".join(pieces) + "\n"
    with pytest.raises(GatelensError, match="--length must be zero or positive"):
        sample.sample_chunks(run, -1)  # refused before the first piece, not when iterated
