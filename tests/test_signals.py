"""SIGTERM and SIGHUP stop gatelens as Ctrl-C does (issue 26, part 5): ``train`` saves its
state at the step, marks the run interrupted, releases the lock and exits 128 + the signal
with one line; ``analyze`` leaves no temporary directory and no half-written analysis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatelens.cli import main
from gatelens.lock import LOCK
from gatelens.stops import Stopped, exit_code, kept_handlers, may_take, signals_raise
from gatelens.training.config import TrainConfig
from gatelens.training.runs import read_config
from gatelens.training.train import train


def _defaults() -> None:
    """SIGTERM and SIGHUP at their defaults in the child, even under ``nohup``."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _start(argv: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONWARNINGS="error")
    return subprocess.Popen([sys.executable, "-m", "gatelens.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_defaults)


def _wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.time() + 120
    while not ready():
        assert proc.poll() is None and time.time() < deadline, (what, proc.communicate())
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_train_saves_its_step_and_releases_the_lock(tiny_text, tmp_path, sig,
                                                                 capsys):
    args = ["train", "--corpus", str(tiny_text), "--hidden", "16", "--steps", "800",
            "--batch", "8", "--seq", "32", "--eval-every", "200", "--val-windows", "2",
            "--quiet"]
    cut = tmp_path / "cut"
    proc = _start([*args, "--out", str(cut)])
    _wait_for(proc, (cut / "checkpoints" / "step-000000.safetensors").exists, "step 0")
    time.sleep(0.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.fail(f"training finished before {sig.name}; make the run longer")
    assert proc.returncode == 128 + sig, err
    config = read_config(cut)
    stopped = config["steps_done"]
    assert 0 < stopped < 800 and config["status"] == "interrupted"
    assert err.splitlines() == [f"gatelens: stopped at step {stopped} of 800 ({sig.name}); "
                                f"continue with `gatelens train --resume --out {cut}`"]
    assert not (cut / LOCK).exists()
    # the state at the step, not at the last evaluation: resuming trains the rest only
    assert main(["train", "--resume", "--out", str(cut), "--quiet", "--steps",
                 str(stopped + 1)]) == 0
    assert read_config(cut)["steps_done"] == stopped + 1
    capsys.readouterr()


def test_a_terminated_analyze_leaves_nothing_half_written(tiny_text, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--corpus", str(tiny_text), "--hidden", "24", "--steps", "2",
                 "--batch", "4", "--seq", "16", "--eval-every", "2", "--val-windows", "2",
                 "--quiet", "--out", str(run)]) == 0
    capsys.readouterr()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    proc = _start(["analyze", str(run), "--windows", "16", "--length", "128",
                   "--exponents", "all", "--fixed-points"])
    lines: list[str] = []
    _wait_for(proc, lambda: lines.append(proc.stderr.readline()) or "tracing" in lines[-1],
              "the tracing line")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (lines, err)
    assert err.splitlines()[-1] == "gatelens: interrupted by SIGTERM"
    assert "Traceback" not in err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # no analysis, no tmp


def test_signals_raise_stops_by_sigterm_and_sighup_and_restores_the_handlers():
    old = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for sig in old:
            with pytest.raises(Stopped) as got, signals_raise():
                assert may_take(sig)
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler raises before this ends
            assert got.value.signum == sig and exit_code(got.value) == 128 + sig
            assert signal.getsignal(sig) == signal.SIG_DFL  # put back
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_an_ignored_sighup_stays_ignored(tmp_path: Path):
    """nohup ignores SIGHUP: gatelens neither stops on it nor takes the handler over."""
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals_raise():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and not may_take(
                signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_library_that_turns_the_stop_into_ctrl_c_still_exits_by_its_signal():
    """Ray's ray.get/ray.wait catch the Stopped and raise a plain KeyboardInterrupt."""
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(Stopped) as got, signals_raise():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except Stopped:
                raise KeyboardInterrupt from None
        assert exit_code(got.value) == 143
        with pytest.raises(KeyboardInterrupt) as plain, signals_raise():
            raise KeyboardInterrupt  # Ctrl-C stays Ctrl-C: 130
        assert not isinstance(plain.value, Stopped) and exit_code(plain.value) == 130
    finally:
        signal.signal(signal.SIGTERM, old)


def test_kept_handlers_undo_what_a_library_installs():
    old = signal.getsignal(signal.SIGTERM)
    with signals_raise():
        mine = signal.getsignal(signal.SIGTERM)
        with kept_handlers():
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))  # what ray.init does
        assert signal.getsignal(signal.SIGTERM) is mine
    assert signal.getsignal(signal.SIGTERM) == old


def test_a_stop_outside_the_loop_leaves_the_run_interrupted_not_running(tiny_text, tmp_path,
                                                                        capsys):
    """A second SIGTERM (the loop's flag raises it where the loop is) or one before the
    loop: config.json says "interrupted", the lock is gone, --resume continues."""
    run = tmp_path / "run"

    def second_signal(step: int) -> None:
        if step == 3:
            raise Stopped(signal.SIGTERM)

    cfg = TrainConfig(corpus=str(tiny_text), hidden=8, steps=6, batch=4, seq=16,
                      eval_every=2, val_windows=2)
    with pytest.raises(Stopped):
        train(cfg, run, progress=False, on_step=second_signal)
    config = read_config(run)
    assert config["status"] == "interrupted" and config["steps_done"] == 2
    assert not (run / LOCK).exists()
    assert main(["train", "--resume", "--out", str(run), "--quiet"]) == 0
    assert read_config(run)["status"] == "done" and read_config(run)["steps_done"] == 6
    capsys.readouterr()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_reproduce_says_where_in_one_line(capsys, tiny_text, tmp_path, monkeypatch,
                                                    sig):
    """reproduce printed train's line (naming `gatelens train --resume`) and then its own:
    two lines, the first advice not the one that continues a reproduction."""
    import gatelens.training.train as tr

    def stopped(cfg, run, **kw):  # train() as a signal at step 22 leaves it
        return tr.TrainResult(Path(run), 22, 0, 3.0, True, int(sig), 800)
    monkeypatch.setattr(tr, "train", stopped)
    assert main(["reproduce", "--corpus", str(tiny_text), "--out", str(tmp_path / "r"),
                 "--quiet"]) == 128 + sig
    by = "" if sig == signal.SIGINT else " by SIGTERM"
    assert capsys.readouterr().err.splitlines() == [
        f"gatelens: interrupted{by}: lstm stopped at step 22 of 800; rerun the same "
        "`gatelens reproduce` command to continue"]
