"""One writer per directory: a second gatelens process on a run, a study or a trial is one
line naming the holder (exit 2); a killed holder's lock is stale and taken over with a
note; a study never clears a run another process is writing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.lock import LOCK, holder, locked
from gatelens.studies.spec import parse_spec
from gatelens.training.runs import read_config, read_metadata

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import one_line  # noqa: E402

SMALL = ["--hidden", "8", "--batch", "4", "--seq", "16", "--val-windows", "2", "--quiet"]
# another holder, speaking the lock's protocol (flock + who) without importing gatelens
HOLD = """
import fcntl, json, os, socket, sys, time
fd = os.open(os.path.join(sys.argv[1], ".gatelens.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                         "since": "now"}).encode())
print("held", flush=True)
time.sleep(120)
"""


def hold(directory: Path) -> subprocess.Popen:
    """Another process holding DIR's lock until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_second_train_on_a_running_run_is_refused_then_a_killed_one_is_resumed(
        capsys, tiny_text, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--corpus", str(tiny_text), *SMALL, "--steps", "100000", "--eval-every",
            "50", "--out", str(run)]
    proc = subprocess.Popen([sys.executable, "-m", "gatelens.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run / "resume.safetensors").exists() or holder(run).get("pid") != proc.pid:
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.05)
        who = f"pid {proc.pid} on host {socket.gethostname()}"
        assert who in one_line(capsys, args)
        assert who in one_line(capsys, ["train", "--resume", "--out", run, "--quiet"])
        assert who in one_line(capsys, ["train", "--resume", "--steps", "60", "--out", run])
    finally:
        proc.send_signal(signal.SIGKILL)  # as a lost machine: no chance to clean up
        proc.wait(timeout=30)
    assert holder(run)["pid"] == proc.pid  # the dead process's lock file is still there
    done = int(read_metadata(run / "resume.safetensors")["step"])
    assert main(["train", "--resume", "--steps", str(done + 2), "--out", str(run),
                 "--quiet"]) == 0
    assert read_config(run)["steps_done"] == done + 2
    err = capsys.readouterr().err
    assert f"taking over the lock of pid {proc.pid}" in err and "no longer running" in err
    assert not (run / LOCK).exists()  # released when done


def test_a_study_directory_held_by_another_process_is_refused_before_any_work(
        capsys, tiny_text, tmp_path, monkeypatch):
    import gatelens.studies.study as study

    out = tmp_path / "study"
    out.mkdir()
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[grid]\nseed = [0]\n[train]\ncorpus = "{tiny_text}"\nhidden = 8\n'
                    'steps = 2\n', encoding="utf-8")
    monkeypatch.setattr(study, "_import_ray", lambda: pytest.fail("Ray started"))
    proc = hold(out)
    try:
        line = one_line(capsys, ["study", spec, "--out", out, "--quiet"])
        assert f"{out}: in use by another gatelens (pid {proc.pid} on host" in line
    finally:
        stop(proc)
    assert list(out.iterdir()) == [out / LOCK]  # nothing written; the dead holder's file


def test_a_trial_waits_for_a_held_directory_and_never_clears_a_run_being_written(
        tiny_text, tmp_path, monkeypatch):
    import gatelens.studies.trial as study

    trial = parse_spec({"grid": {"seed": [0]}, "train": {"corpus": str(tiny_text),
                                                         "hidden": 8, "steps": 2}}).trials[0]
    run = tmp_path / "trials" / trial.id / "run"
    run.mkdir(parents=True)
    (run / "history.csv").write_text("step,train_loss,val_loss,seconds\n")  # a start
    proc = hold(run)  # e.g. `gatelens train --out` on it by hand
    try:
        with pytest.raises(GatelensError, match=f"in use by another gatelens \\(pid {proc.pid}"):
            study._train(trial, run)
        assert (run / "history.csv").exists()  # not removed under the writer
        monkeypatch.setattr(study, "LOST_HOLDER_WAIT", 0.3)
        trial_dir = run.parent
        other = hold(trial_dir)
        try:
            t0 = time.perf_counter()
            rec = study.run_trial(trial, tmp_path)
            assert time.perf_counter() - t0 >= 0.3  # it waited for the holder
            assert rec["status"] == "failed" and f"pid {other.pid}" in rec["error"]
            assert not (trial_dir / "trial.json").exists()  # not its directory to write
        finally:
            stop(other)
    finally:
        stop(proc)
    with locked(trial_dir, quiet=True):  # the holders are gone: their locks are stale
        assert study._train(trial, run) == "trained"  # the dead start is cleared, then run
    assert read_config(run)["status"] == "done"
    assert not (trial_dir / LOCK).exists() and not (run / LOCK).exists()


def test_the_lock_is_reentrant_in_one_process_and_names_its_holder(tmp_path):
    with locked(tmp_path) as d:
        assert d == tmp_path and holder(tmp_path)["pid"] == os.getpid()
        with locked(tmp_path):
            assert (tmp_path / LOCK).exists()
        assert (tmp_path / LOCK).exists()  # the outer block still holds it
    assert not (tmp_path / LOCK).exists()
    (tmp_path / LOCK).write_text("not json")  # a holder that died mid-write
    with locked(tmp_path, quiet=True):
        assert holder(tmp_path)["pid"] == os.getpid()
