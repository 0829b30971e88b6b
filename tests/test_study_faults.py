"""A study on a two-node Ray cluster that loses its worker node in the middle of a trial.

The head and the worker are separate `ray start` processes on this machine (token
authentication, as Ray starts it; health checks every 0.5 s so a dead node is noticed in
seconds). The study is submitted with --address; once a trial running on the worker node
has saved a checkpoint, every process of that node (its raylet, its agents and the task's
worker process, which Ray starts in a session of its own, so it is found by parentage) is
killed with SIGKILL, as when a machine is lost. The study must still
end with every trial done once: the lost trial is submitted again, takes over the dead
task's stale lock and resumes its run, and study.json's figures equal those of the same
trials run on one machine. Nothing of the cluster is left running afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gatelens.lock import holder
from gatelens.studies.spec import load_spec
from gatelens.studies.study import run_study, run_trial

# Ray clusters and sessions of their own: these tests run on one xdist worker, in turn
pytestmark = pytest.mark.xdist_group("ray")

TEXT = "\n".join(" ".join(("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
                           "dog")[(i * 5 + k * k) % 9] for k in range(8)) for i in range(300))
HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000",
          "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    return kids


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (Ray's task workers are in sessions of their own,
    so a process group does not hold them)."""
    kids, out, todo = _children(), set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo += kids.get(p, [])
    return out


def kill_all(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.add(p)
    return out


def _ray(*args: str, env: dict, **kw) -> subprocess.Popen:
    ray = Path(sys.executable).with_name("ray")
    return subprocess.Popen([str(ray), "start", *args, "--num-cpus", "1", "--block",
                             "--disable-usage-stats"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, **kw)


def _forget_cluster(port: int) -> None:
    note = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    if note.exists() and note.read_text().strip().endswith(f":{port}"):
        note.unlink()


def _figures(study: dict) -> dict:
    return {"conditions": study["conditions"],
            "trials": {t["id"]: (t["status"], t["figures"],
                                 [(c["step"], c["val_loss"], c["figures"])
                                  for c in t["checkpoints"]]) for t in study["trials"]}}


def _until(cond, what: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"{what}: the study ended first"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_study_survives_losing_a_worker_node_mid_trial(tmp_path, monkeypatch):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[grid]\nseed = [0, 1]\n[train]\ncorpus = "{corpus}"\nhidden = 8\n'
                    "steps = 300\neval_every = 150\nbatch = 4\nseq = 24\nval_windows = 4\n"
                    "[analysis]\nwindows = 2\nlength = 24\nperturb_pos = 8\n", encoding="utf-8")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", **HEALTH}
    head = _ray("--head", "--port", str(port), "--include-dashboard", "false", env=env)
    worker = _ray("--address", address, env=env)  # it waits for the head to answer
    study = None
    everything: set[int] = set()
    try:
        ray = str(Path(sys.executable).with_name("ray"))
        def cpus() -> str:
            got = subprocess.run([ray, "status", "--address", address], env=env,
                                 capture_output=True, text=True)
            return got.stdout if got.returncode == 0 else ""
        # both nodes in before the study starts, so one trial is sure to run on the worker
        _until(lambda: "/2.0 CPU" in cpus(), "the head and the worker node", 180)
        out = tmp_path / "out"
        study = subprocess.Popen(
            [sys.executable, "-c", "import sys; from gatelens.cli import main; "
             "sys.exit(main(sys.argv[1:]))", "study", str(spec), "--out", str(out),
             "--address", address, "--quiet"], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)

        def on_worker_node() -> str | None:
            """A trial whose task runs on the worker node and has saved a checkpoint."""
            node = descendants(worker.pid)
            for d in sorted((out / "trials").glob("*")) if (out / "trials").is_dir() else []:
                if holder(d).get("pid") in node and (d / "run" / "resume.safetensors").exists():
                    return d.name
            return None
        _until(lambda: on_worker_node() is not None, "a trial on the worker node", 240, study)
        lost = on_worker_node()
        node = descendants(worker.pid)
        kill_all(node)  # the machine is gone: raylet, agents, the trial's worker process
        everything |= node
        stdout, stderr = study.communicate(timeout=240)
        assert study.returncode == 0, stderr[-3000:]
        assert f"{lost}: its task was lost" in stderr and "attempt 2 of 3" in stderr, stderr
        result = json.loads((out / "study.json").read_text(encoding="utf-8"))
        records = {t["id"]: json.loads((out / "trials" / t["id"] / "trial.json").read_text())
                   for t in result["trials"]}
        assert [t["status"] for t in result["trials"]] == ["done", "done"]
        assert {i: r["attempts"] for i, r in records.items()} == {
            i: 2 if i == lost else 1 for i in records}
        assert records[lost]["how"] in ("resumed", "analysed")  # not retrained from scratch
        assert [c["step"] for c in records[lost]["checkpoints"]] == [0, 150, 300]
    finally:
        for p in (head, worker):
            if p is not None:
                everything |= descendants(p.pid)
        kill_all(everything)
        for p in (head, worker, study):
            if p is not None:
                p.wait(timeout=60)
        _forget_cluster(port)
    time.sleep(0.2)
    assert alive(everything) == set(), "cluster processes left running"

    # the same study on one machine: the lost trial run again here, uninterrupted (one
    # thread, as its Ray task had; no PNGs, which hold no figures), the other trial as the
    # cluster ran it (it was never interrupted); merged without Ray
    import gatelens.report.write as write

    monkeypatch.setattr(write, "write_plots", lambda *a, **kw: [])
    ref = tmp_path / "ref"
    for trial in load_spec(spec).trials:
        if trial.id == lost:
            assert run_trial(trial, ref, threads=1)["status"] == "done"
        else:
            shutil.copytree(out / "trials" / trial.id, ref / "trials" / trial.id)
    alone = run_study(spec, ref, progress=False).study
    assert _figures(alone) == _figures(result)
    assert _figures(alone)["trials"][lost] == _figures(result)["trials"][lost]


@pytest.fixture(autouse=True)
def _restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
