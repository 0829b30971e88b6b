"""Training step time: `gatelens train`'s loop / a plain PyTorch loop, same model and batch.

    python benchmarks/bench_train.py            # seed size: LSTM 325, B 32, T 128, V 85
    python benchmarks/bench_train.py --quick    # small, for a smoke run
    python benchmarks/bench_train.py --full     # also the default 800-step run's wall time

Both loops run in this process, alternated, and the ratio of median step times is
printed (goal <= 1.05). gatelens's step time comes from its own history.csv (seconds
column), between step 1 and the last step, so the step-0 evaluation is left out.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gatelens.training.config import TrainConfig
from gatelens.training.train import train


def synthetic_corpus(path: Path, vocab: int, n: int = 300_000) -> Path:
    rng = random.Random(0)
    chars = [chr(32 + k) for k in range(vocab - 1)] + ["\n"]
    path.write_text("".join(rng.choice(chars) for _ in range(n)), encoding="utf-8")
    return path


def gatelens_step_time(corpus: Path, H: int, B: int, T: int, steps: int, work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    cfg = TrainConfig(corpus=str(corpus), hidden=H, batch=B, seq=T, steps=steps,
                      eval_every=steps, val_windows=1, device="cpu")
    train(cfg, out, progress=True)
    with open(out / "history.csv") as fh:
        secs = {int(r["step"]): float(r["seconds"]) for r in csv.DictReader(fh)}
    return (secs[steps] - secs[1]) / (steps - 1)


def plain_step_time(V: int, H: int, B: int, T: int, steps: int, n_train: int) -> float:
    torch.manual_seed(0)
    rnn, head = nn.LSTM(V, H, batch_first=True), nn.Linear(H, V)
    params = list(rnn.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=2e-3)
    data = torch.randint(0, V, (n_train,))
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        starts = torch.randint(0, n_train - T, (B,), generator=gen)
        ids = data[starts[:, None] + torch.arange(T + 1)]  # (B, T + 1)
        x = F.one_hot(ids[:, :-1], V).float()  # (B, T, V)
        logits = head(rnn(x)[0])  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 5.0)
        opt.step()
        float(loss.detach())
        times.append(time.perf_counter() - t)
    return sum(times[1:]) / (steps - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true", help="also time the default 800-step run")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    V, H, B, T, steps = (85, 64, 8, 32, 10) if args.quick else (85, 325, 32, 128, 25)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = synthetic_corpus(work / "corpus.txt", V)
        ours, plain = [], []
        for _ in range(args.repeats):
            plain.append(plain_step_time(V, H, B, T, steps, 270_000))
            ours.append(gatelens_step_time(corpus, H, B, T, steps, work))
        o, p = statistics.median(ours), statistics.median(plain)
        print(f"train step, LSTM H={H} B={B} T={T} V={V}, threads={torch.get_num_threads()}:")
        print(f"  gatelens {o * 1e3:.1f} ms  plain {p * 1e3:.1f} ms  ratio {o / p:.3f}"
              "  (goal <= 1.05)")
        if args.full:
            t = time.perf_counter()
            train(TrainConfig(device="cpu"), work / "default", progress=True)
            print(f"default 800-step training (shakespeare, LSTM 325): "
                  f"{time.perf_counter() - t:.0f} s wall")


if __name__ == "__main__":
    main()
