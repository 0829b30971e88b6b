"""SIGTERM stops a study as Ctrl-C does (issue 26, part 5): ``ray.init`` installs a SIGTERM
handler that exits without unwinding and a C one that prints a stack dump
("*** SIGTERM received at time=… PC: @ …"); gatelens puts its own back, so the study stops
Ray, releases its lock and exits 143 with one line, leaving no Ray process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gatelens.lock import LOCK

# a local Ray of its own: on the one xdist worker that runs the Ray tests in turn
pytestmark = pytest.mark.xdist_group("ray")


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += kids.get(p, [])
    return out


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.add(p)
        except (OSError, IndexError):
            pass
    return out


def _defaults() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def test_a_terminated_study_stops_ray_without_a_stack_dump(tiny_text, tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[grid]\nseed = [0]\n[train]\ncorpus = "{tiny_text}"\nhidden = 8\n'
                    "steps = 100000\neval_every = 50000\nbatch = 4\nseq = 24\n"
                    "val_windows = 4\n[analysis]\nwindows = 2\nlength = 24\nperturb_pos = 8\n",
                    encoding="utf-8")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "gatelens.cli", "study", str(spec), "--out",
                             str(out), "--workers", "1", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_defaults,
                            env={**os.environ, "PYTHONWARNINGS": "error"})
    first = out / "trials" / "seed-0" / "run" / "checkpoints" / "step-000000.safetensors"
    deadline = time.monotonic() + 180
    everything: set[int] = set()
    try:
        while not first.exists():  # the trial trains, in a Ray worker
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        everything = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == "gatelens: interrupted by SIGTERM", err
    for dump in ("SIGTERM received", "PC: @", "Traceback", "logging.cc"):
        assert dump not in err, err
    assert not (out / LOCK).exists()  # the study's lock released
    time.sleep(0.5)
    assert _alive(everything - {proc.pid}) == set(), "Ray processes left running"
