"""Benchmark ``gatelens analyze`` at the seed's size: B=32, T=128, H=325, V=85.

Builds a run directory from a random, untrained LSTM (no training needed: the step-0
checkpoint is the same weights), then times the stages of ``analyze``. Goal: all
measurements (trace, verification, distributions, timescales, perturbation, classes) in
≤ 10 s on 2 CPU cores. ``--quick`` uses H=64 and B=8 for a smoke run.

    .venv/bin/python benchmarks/bench_analyze.py [--quick] [--cell lstm|gru|rnn]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from gatelens.lens.analyze import analyze
from gatelens.training.config import TrainConfig
from gatelens.training.model import CharLM
from gatelens.training.runs import save_weights

CHARS = [chr(c) for c in range(32, 117)]  # 85 printable characters, as the seed's corpus


def make_run(root: Path, cell: str, hidden: int, windows: int, length: int) -> Path:
    """A run directory holding a random model (as best and as the step-0 checkpoint)."""
    rng = random.Random(0)
    text = "".join(rng.choice(CHARS) for _ in range(windows * length * 12))
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    torch.manual_seed(0)
    model = CharLM(len(CHARS), hidden=hidden, cell=cell)
    cfg = TrainConfig(corpus=str(root / "corpus.txt"), cell=cell, hidden=hidden)
    run = root / "run"
    config = {"model": {"cell": cell, "hidden": hidden, "layers": 1, "embed": None,
                        "nonlinearity": "tanh"},
              "vocab": sorted(set(text)), "train": cfg.to_dict(),
              "corpus": {"name": cfg.corpus, "source": cfg.corpus}, "best": {"step": 0,
                                                                             "val_loss": None}}
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config), encoding="utf-8")
    save_weights(run / "model.safetensors", model.state_dict())
    save_weights(run / "checkpoints" / "step-000000.safetensors", model.state_dict())
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    ap.add_argument("--cell", default="lstm", choices=["lstm", "gru", "rnn"])
    args = ap.parse_args(argv)
    B, T, H = (8, 64, 64) if args.quick else (32, 128, 325)
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp), args.cell, H, B, T)
        timings: dict = {}
        t0 = time.perf_counter()
        a = analyze(run, windows=B, length=T, perturb_pos=32, out=Path(tmp) / "out",
                    progress=False, timings=timings)
        total = time.perf_counter() - t0
    measure = sum(timings[k] for k in ("trace", "verification", "divergence", "analyses"))
    print(f"analyze {args.cell} B={B} T={T} H={H} V={len(CHARS)} "
          f"threads={torch.get_num_threads()}")
    for k, v in timings.items():
        print(f"  {k:<14} {v:6.2f} s")
    print(f"  {'measurements':<14} {measure:6.2f} s (trace + verification + divergence + "
          f"analyses; goal <= 10 s)")
    print(f"  {'total':<14} {total:6.2f} s (with loading, report and plots)")
    v = a.report["verification"]
    print(f"  gate values {a.report['gates']['n_values']}, one-step |dh| "
          f"{v['one_step_max_abs_diff_h']:.2e}, "
          f"free-running {v['free_running_max_abs_diff_h']:.2e}")
    return 0 if measure <= 10 or args.quick else 1


if __name__ == "__main__":
    raise SystemExit(main())
