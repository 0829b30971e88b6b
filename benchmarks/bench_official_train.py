"""The official implementations' training step time against the LSTM's, at its parameter count.

    OMP_NUM_THREADS=1 python benchmarks/bench_official_train.py          # the modern-official
                                                                         # preset's models, V 84
    OMP_NUM_THREADS=1 python benchmarks/bench_official_train.py --quick  # small, a smoke run
    ... --cells hf-mamba,hf-rwkv --budget 60                             # some, 60 s each
    ... --model hf-mamba:2:96 --model xlstm-mlstm:2:96:8   # CELL:LAYERS[:WIDTH[:HEADS]]

Each model is ``gatelens train --cell ...``'s (``build``: the package's module in an
OfficialLM) at the hidden size whose parameter count is nearest the 325-unit LSTM's
(``matched_hidden``, the preset's ``match_params = "lstm"``). A training step is the
loop's own: ``loss_on`` (forward, cross-entropy), backward, gradient clipping and an Adam
step, B = 32, T = 128, one torch thread as in a study trial. The figure is the median over
the timed steps after one warm-up step (at most ``--steps``, within ``--budget`` seconds
a model), with the LSTM's measured in the same process for the ratio. The last column
is 800 steps at that rate (the preset's trial, before its evaluations and analyses).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from gatelens.training.config import TrainConfig
from gatelens.training.model import matched_hidden, parameter_count
from gatelens.training.train import build, loss_on, model_config

#: the official models (cell, layers, heads) at the LSTM's count, the LSTM first; the
#: modern-official preset takes sLSTM as 192 x 1 and Mamba as 96 x 2 (--model, below)
MODELS = (("lstm", 1, 1), ("xlstm-slstm", 2, 4), ("xlstm-mlstm", 2, 32), ("mingru-lm", 2, 1),
          ("hf-mamba", 2, 1), ("hf-rwkv", 2, 1), ("hf-mamba2", 2, 1), ("mambapy", 2, 1))


def step_time(cfg: TrainConfig, V: int, steps: int, budget: float) -> tuple[float, int, int]:
    """(median seconds per training step, steps timed, parameters)."""
    model = build(cfg, V)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    start = time.perf_counter()
    for k in range(steps + 1):
        ids = torch.randint(0, V, (cfg.batch, cfg.seq + 1), generator=gen)  # (B, T + 1)
        t0 = time.perf_counter()
        loss = loss_on(model, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        if k:  # the first step warms up (allocations, lazy imports)
            times.append(time.perf_counter() - t0)
        if k and time.perf_counter() - start > budget:
            break
    return statistics.median(times), len(times), sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="V 30, B 4, T 32, LSTM H 32")
    ap.add_argument("--cells", default=None, help="comma-separated cells (default: all)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps at most (default 5)")
    ap.add_argument("--budget", type=float, default=50.0, help="seconds per model (default 50)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a study trial's 1)")
    ap.add_argument("--model", action="append", default=[], metavar="CELL:LAYERS[:WIDTH[:HEADS]]",
                    help="time this model instead (width: matched to the LSTM when left out)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*fast path is not available.*")
    torch.set_num_threads(args.threads)
    V, B, T, H = (30, 4, 32, 32) if args.quick else (84, 32, 128, 325)
    chosen = None if args.cells is None else set(args.cells.split(","))
    target = parameter_count({"cell": "lstm", "hidden": H, "layers": 1}, V)
    print(f"training step, B {B}, T {T}, V {V}, {args.threads} thread(s); LSTM H {H}: "
          f"{target} parameters")
    print("| cell | d × layers | parameters | ms / step | × LSTM | 800 steps |")
    print("|---|---|---|---|---|---|")
    base = None
    models = [(c, layers, h, None) for c, layers, h in MODELS
              if c == "lstm" or chosen is None or c in chosen]
    if args.model:
        models = models[:1] + [_parse(m) for m in args.model]
    for cell, layers, heads, width in models:
        cfg = TrainConfig(cell=cell, layers=layers, heads=heads, hidden=H, batch=B, seq=T)
        if cell != "lstm":
            cfg.hidden = width or matched_hidden(model_config(cfg), target, V)
        cfg.validate()
        t, n, params = step_time(cfg, V, args.steps, args.budget)
        base = base or t
        print(f"| {cell} | {cfg.hidden} × {layers} | {params:,} | {1e3 * t:.0f} "
              f"| {t / base:.2f} | {800 * t / 60:.1f} min | ({n} steps)", flush=True)


def _parse(text: str) -> tuple[str, int, int, int | None]:
    cell, layers, *rest = text.split(":")
    heads = int(rest[1]) if len(rest) > 1 else dict((c, h) for c, _, h in MODELS).get(cell, 1)
    return cell, int(layers), heads, int(rest[0]) if rest and rest[0] else None


if __name__ == "__main__":
    main()
