"""Benchmark ``gatelens study``: trials per hour with 1 and 2 Ray workers, and Ray's overhead
per trial (a trial's wall time as a Ray task minus the same trial run in-process).

A fixed small trial: LSTM, H=32, 40 steps of batch 8 x 64 characters, a checkpoint every
20 steps (3 analysed: 0, 20, 40) on 8 windows of 64 characters. Workers are warmed with one
trial each first (a fresh worker imports torch and warms up the divergence code), so the
figures are the steady state (the best of two repeats); Ray's start is reported apart.

    .venv/bin/python benchmarks/bench_study.py [--trials 4]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from gatelens.studies.spec import Trial, parse_spec
from gatelens.studies.study import ray_session, run_ray, run_trial

WORDS = "the quick brown fox jumps over a lazy dog and then runs home to sleep".split()
TRAIN = {"cell": "lstm", "hidden": 32, "steps": 40, "eval_every": 20, "batch": 8, "seq": 64,
         "val_windows": 8}
ANALYSIS = {"windows": 8, "length": 64, "perturb_pos": 16}
REPEATS = 2  # the best of two: on shared cores other jobs only ever slow a run down


def trials(corpus: Path, seeds: list[int]) -> list[Trial]:
    return parse_spec({"grid": {"seed": seeds}, "train": {"corpus": str(corpus), **TRAIN},
                       "analysis": ANALYSIS}).trials


def in_process(todo: list[Trial], out: Path) -> float:
    """Seconds per trial, run one after another in this process with one torch thread."""
    run_trial(trials(Path(todo[0].train["corpus"]), [999])[0], out / "warm", 1)
    best = float("inf")
    for rep in range(REPEATS):
        t0 = time.perf_counter()
        for t in todo:
            assert run_trial(t, out / f"rep{rep}", 1)["status"] == "done"
        best = min(best, (time.perf_counter() - t0) / len(todo))
    return best


def with_ray(todo: list[Trial], out: Path, workers: int) -> tuple[float, float, float]:
    """(Ray's start, wall seconds per trial, seconds per trial inside the tasks) with
    ``workers`` workers."""
    t0 = time.perf_counter()
    with ray_session(workers=workers):
        start = time.perf_counter() - t0
        warm = trials(Path(todo[0].train["corpus"]), [1000 + k for k in range(workers)])
        run_ray(warm, out / "warm", workers=workers, progress=False)
        best, inside = float("inf"), 0.0
        for rep in range(REPEATS):
            t0 = time.perf_counter()
            recs = run_ray(todo, out / f"rep{rep}", workers=workers, progress=False)
            wall = (time.perf_counter() - t0) / len(todo)
            assert all(r["status"] == "done" for r in recs)
            if wall < best:
                best, inside = wall, sum(r["seconds"] for r in recs) / len(recs)
    return start, best, inside


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4, help="trials per measurement (default 4)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = random.Random(0)
        corpus = root / "corpus.txt"
        corpus.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(8))
                                    for _ in range(2000)), encoding="utf-8")
        seeds = list(range(args.trials))
        local = in_process(trials(corpus, seeds), root / "local")
        start1, ray1, inside1 = with_ray(trials(corpus, seeds), root / "ray1", 1)
        start2, ray2, _ = with_ray(trials(corpus, seeds), root / "ray2", 2)
    print(f"trial: {TRAIN}, analysis {ANALYSIS}, 3 checkpoints; {args.trials} trials each; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, sec, start in (("in-process", local, None), ("Ray, 1 worker", ray1, start1),
                             ("Ray, 2 workers", ray2, start2)):
        print(f"{name:15s} {sec:6.2f} s/trial {3600 / sec:7.0f} trials/h"
              + ("" if start is None else f"  (Ray start {start:.1f} s)"))
    print(f"Ray overhead per trial, 1 worker: wall {ray1:.2f} s - in-task {inside1:.2f} s = "
          f"{ray1 - inside1:+.3f} s; wall minus in-process {ray1 - local:+.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
