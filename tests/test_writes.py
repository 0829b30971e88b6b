"""Writes as transactions: an analysis appears whole or the old one stays (failure, Ctrl-C);
a run's model.safetensors and config.json agree on the best step after any failed write;
every OSError on a write (disk full, read-only, no permission, a file where a directory
should be) is one line naming the path, exit 2, checked before long work where it can be.
Tests run as root, who ignores chmod: permissions and read-only file systems are
simulated by making os.replace raise what the kernel would."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import gatelens.io as gio
from gatelens.cli import main
from gatelens.errors import GatelensError, WriteError
from gatelens.io import check_out_dir, replace_dir
from gatelens.lock import is_lock_or_leftover
from gatelens.report.write import write_analysis
from gatelens.training.config import TrainConfig
from gatelens.training.runs import load_run, read_config, read_metadata
from gatelens.training.train import train

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import SMALL, one_line  # noqa: E402

FAILURES = [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system"),
            (errno.EACCES, "Permission denied")]


def files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file()}


def fail_with(monkeypatch, code: int, text: str, after: int = 0):
    """os.replace raises OSError(code) from its (after + 1)-th call on."""
    real, calls = os.replace, []

    def replace(src, dst, *a, **kw):
        calls.append(dst)
        if len(calls) > after:
            raise OSError(code, text)
        return real(src, dst, *a, **kw)
    monkeypatch.setattr(os, "replace", replace)
    return calls


@pytest.fixture(scope="module")
def analysis(analysis_of):
    return analysis_of("lstm", windows=2, length=24, hidden=6)


def test_an_analysis_appears_whole_or_the_old_one_stays(analysis, tmp_path, monkeypatch):
    import gatelens.report.write as write

    out = tmp_path / "analysis"
    write_analysis(analysis, out, plots=False)
    before = files(out)
    assert {"report.json", "report.md", "report.html", "page_data.json"} <= set(before)
    real_html = write.write_html

    def half(a):  # everything but the page is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(a.out / "report.html"))
    monkeypatch.setattr(write, "write_html", half)
    with pytest.raises(WriteError, match="report.html: cannot write: No space left"):
        write_analysis(analysis, out, plots=False)
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["analysis"]
    assert analysis.out == out

    def ctrl_c(a):
        raise KeyboardInterrupt
    monkeypatch.setattr(write, "write_html", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        write_analysis(analysis, out, plots=False)
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["analysis"]

    monkeypatch.setattr(write, "write_html", real_html)
    real_rename, calls = os.rename, []

    def rename(src, dst):  # the old result moved aside, then the new one fails to move in
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        write_analysis(analysis, out, plots=False)
    assert len(calls) == 3  # aside, in (interrupted), back
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["analysis"]


def test_an_analysis_never_replaces_a_directory_holding_other_files(analysis, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(GatelensError, match="holds notes.txt, which is not part of an analysis"):
        write_analysis(analysis, tmp_path, plots=False)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_replace_dir_puts_a_new_directory_in_place_of_none(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "x").write_text("1")
    replace_dir(tmp_path / "new", tmp_path / "dest")
    assert (tmp_path / "dest" / "x").read_text() == "1" and not (tmp_path / "new").exists()


def test_best_step_agrees_between_weights_and_config_after_a_full_disk(tiny_text, tmp_path,
                                                                       monkeypatch, capsys):
    import gatelens.training.checkpoints as tr  # where a step saves its weights

    cfg = TrainConfig(corpus=str(tiny_text), hidden=8, steps=6, batch=4, seq=16, eval_every=2,
                      val_windows=2, lr=1e-2, device="cpu")
    train(cfg, tmp_path / "full", progress=False)
    best = read_config(tmp_path / "full")["best"]["step"]
    assert best > 0, "the test needs a run whose best step moves"
    real = tr.save_weights

    def full_disk_after_the_best(path, tensors, meta=None):
        real(path, tensors, meta)
        if path.name == "model.safetensors" and int(meta["step"]) == best:
            raise OSError(errno.ENOSPC, "No space left on device")  # resume, config unwritten
    monkeypatch.setattr(tr, "save_weights", full_disk_after_the_best)
    with pytest.raises(OSError):
        train(cfg, tmp_path / "cut", progress=False)
    monkeypatch.setattr(tr, "save_weights", real)
    cut = tmp_path / "cut"
    raw = json.loads((cut / "config.json").read_text())
    assert raw["best"]["step"] < best  # config.json itself is behind the weights file
    assert int(read_metadata(cut / "model.safetensors")["step"]) == best
    assert read_config(cut)["best"]["step"] == best  # readers trust the weights file
    assert load_run(cut).step == best
    assert read_config(cut)["best"]["val_loss"] == read_config(tmp_path / "full")["best"][
        "val_loss"]
    assert main(["train", "--resume", "--out", str(cut), "--quiet"]) == 0
    assert files(cut / "checkpoints") == files(tmp_path / "full" / "checkpoints")
    a, b = (load_file(str(d / "model.safetensors")) for d in (cut, tmp_path / "full"))
    assert all((a[k] == b[k]).all() for k in a)
    assert read_config(cut)["best"] == read_config(tmp_path / "full")["best"]


@pytest.mark.parametrize("code, text", FAILURES)
def test_a_failed_write_is_one_line_naming_the_path(capsys, tiny_text, tmp_path, monkeypatch,
                                                    code, text):
    run = tmp_path / "run"
    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(run)]) == 0
    before = files(run)
    fail_with(monkeypatch, code, text)
    line = one_line(capsys, ["train", "--resume", "--steps", "6", "--out", run, "--quiet"])
    assert line.startswith(f"gatelens: error: {run}/") and f"cannot write: {text}" in line
    assert f"[{errno.errorcode[code]}]" in line
    monkeypatch.undo()
    after = files(run)  # the run is still the 4-step one, whole
    assert after["config.json"] == before["config.json"] and after == before
    fail_with(monkeypatch, code, text)
    line = one_line(capsys, ["train", "--corpus", tiny_text, *SMALL, "--out", tmp_path / "new"])
    assert f"{tmp_path / 'new' / 'config.json'}: cannot write: {text}" in line
    monkeypatch.undo()
    assert not (tmp_path / "new").exists()  # no stub left to block a retry
    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(tmp_path / "new"),
                 ]) == 0


def test_a_raw_oserror_anywhere_is_one_line(capsys, tmp_path, monkeypatch):
    import gatelens.report.html as html

    def boom(out, notes=None):
        raise OSError(errno.EROFS, "Read-only file system", str(Path(out) / "report.html"))
    monkeypatch.setattr(html, "rebuild_html", boom)
    (tmp_path / "a").mkdir()
    line = one_line(capsys, ["report", tmp_path / "a"])
    assert line == f"gatelens: error: {tmp_path / 'a' / 'report.html'}: Read-only file " \
                   "system [EROFS]"


def test_an_out_that_cannot_be_a_directory_is_refused_before_any_work(capsys, tiny_text,
                                                                       tmp_path, monkeypatch):
    import gatelens.studies.study as study

    monkeypatch.setattr(study, "_import_ray", lambda: pytest.fail("Ray was started"))
    file = tmp_path / "file"
    file.write_text("x")
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[grid]\nseed = [0]\n[train]\ncorpus = "{tiny_text}"\n', encoding="utf-8")
    for argv in (["train", "--corpus", tiny_text, *SMALL, "--out"], ["study", spec, "--out"],
                 ["reproduce", "--corpus", tiny_text, "--out"],
                 ["analyze", tmp_path, "--out"]):
        assert "exists and is not a directory" in one_line(capsys, [*argv, file])
        assert f"{file} is a file, not a directory" in one_line(capsys, [*argv, file / "sub"])
    monkeypatch.setattr(gio.tempfile, "mkstemp", _raise(errno.EROFS, "Read-only file system"))
    line = one_line(capsys, ["train", "--corpus", tiny_text, *SMALL, "--out", tmp_path / "r"])
    assert f"--out {tmp_path / 'r'}: cannot write in {tmp_path}: Read-only file system" in line
    assert file.read_text() == "x" and not (tmp_path / "r").exists()


def _raise(code: int, text: str):
    def f(*a, **kw):
        raise OSError(code, text)
    return f


def test_check_out_dir_accepts_new_and_existing_directories(tmp_path):
    assert check_out_dir(tmp_path) == tmp_path
    assert check_out_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert sorted(tmp_path.iterdir()) == []  # the probe is gone, nothing created


def test_files_that_must_agree_are_all_written_before_any_is_replaced(tmp_path, monkeypatch):
    from gatelens.io import atomic_write_many

    for name in ("study.json", "study.md", "study.html"):
        (tmp_path / name).write_text("old")
    calls = []

    def write(text, fail=False):
        def f(tmp):
            calls.append(tmp.name)
            if fail:
                raise OSError(errno.ENOSPC, "No space left on device")
            tmp.write_text(text)
        return f
    with pytest.raises(WriteError, match="study.html: cannot write: No space left"):
        atomic_write_many({tmp_path / "study.json": write("new"),
                           tmp_path / "study.md": write("new"),
                           tmp_path / "study.html": write("new", fail=True)})
    assert len(calls) == 3  # the first two were written, then the third failed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.html", "study.json",
                                                          "study.md"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"old"}


def test_a_run_that_died_before_its_first_state_resumes_by_starting_over(capsys, tiny_text,
                                                                         tmp_path, monkeypatch):
    run = tmp_path / "run"
    fail_with(monkeypatch, errno.ENOSPC, "No space left on device", after=1)  # config.json only
    assert "history.csv: cannot write" in one_line(
        capsys, ["train", "--corpus", tiny_text, *SMALL, "--out", run])
    monkeypatch.undo()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]
    assert "holds another run; use --resume" in one_line(
        capsys, ["train", "--corpus", tiny_text, *SMALL, "--out", run])
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    assert "never saved its first state; starting it over" in capsys.readouterr().err
    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(tmp_path / "b")]) == 0
    a, b = files(run), files(tmp_path / "b")  # as if it had never failed
    assert {k: v for k, v in a.items() if k.endswith(".safetensors") and "resume" not in k} \
        == {k: v for k, v in b.items() if k.endswith(".safetensors") and "resume" not in k}

    def losses(h: bytes) -> list:
        return [r.split(b",")[:3] for r in h.splitlines()]
    assert losses(a["history.csv"]) == losses(b["history.csv"])


def _safetensors_full_disk(real, fail_on: str):
    """safetensors' own writer as it reports a full disk: its Rust I/O error inside a
    SafetensorError (no OSError), for any file whose name holds ``fail_on`` (an
    atomic_write's temporary holds its destination's name)."""
    from safetensors import SafetensorError

    def save_file(tensors, filename, *a, **kw):
        if fail_on in Path(filename).name:
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
        return real(tensors, filename, *a, **kw)
    return save_file


def test_a_full_disk_inside_safetensors_is_one_line_naming_the_file(capsys, tiny_text,
                                                                    tmp_path, monkeypatch):
    """The issue's case on a real full disk (a 200 kB tmpfs): safetensors' writer raised
    SafetensorError, exit 1 and a traceback, which faking os.replace never showed."""
    import gatelens.training.runs as runs

    run = tmp_path / "run"
    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(run)]) == 0
    before = files(run)
    monkeypatch.setattr(runs, "save_file", _safetensors_full_disk(runs.save_file,
                                                                  "step-000006.safetensors"))
    line = one_line(capsys, ["train", "--resume", "--steps", "6", "--out", run, "--quiet"])
    assert line == (f"gatelens: error: {run / 'checkpoints' / 'step-000006.safetensors'}: "
                    "cannot write: No space left on device [ENOSPC]")
    after = files(run)  # the last step's history row is written first; nothing else moved
    assert {k: v for k, v in after.items() if k != "history.csv"} == {
        k: v for k, v in before.items() if k != "history.csv"}
    assert not any(is_lock_or_leftover(p.name) for p in run.rglob("*"))


def test_a_full_disk_in_an_analysis_names_the_file_under_out(analysis, tmp_path,
                                                             monkeypatch):
    """The analysis's arrays file (safetensors) on a full disk; and any failed write of an
    analysis is named where it would have been, not inside the temporary directory."""
    import numpy as np
    import safetensors.numpy

    import gatelens.report.write as write

    out = tmp_path / "a"
    write_analysis(analysis, out, plots=False)
    before = files(out)
    monkeypatch.setattr(write, "report_arrays", lambda a: {"units": np.zeros(3)})
    monkeypatch.setattr(safetensors.numpy, "save_file", _safetensors_full_disk(
        safetensors.numpy.save_file, "arrays.safetensors"))
    with pytest.raises(WriteError) as e:
        write_analysis(analysis, out, plots=False)
    assert str(e.value) == f"{out / 'arrays.safetensors'}: cannot write: No space left on " \
                           "device [ENOSPC]"
    monkeypatch.undo()
    fail_with(monkeypatch, errno.ENOSPC, "No space left on device")  # its first file
    with pytest.raises(WriteError) as e:
        write_analysis(analysis, out, plots=False)
    assert str(e.value).startswith(f"{out / 'report.json'}: cannot write: No space left")
    assert files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    from gatelens.lock import LOCK, writing_dir

    monkeypatch.setattr(os, "pwrite", _raise(errno.ENOSPC, "No space left on device"))
    with pytest.raises(WriteError, match=r"\.gatelens\.lock: cannot write: No space left"):
        with writing_dir(tmp_path / "run"):
            pass
    assert not (tmp_path / "run").exists()  # neither the lock nor the directory it made
    (tmp_path / "old").mkdir()
    with pytest.raises(WriteError):
        with writing_dir(tmp_path / "old"):
            pass
    assert not (tmp_path / "old" / LOCK).exists()
