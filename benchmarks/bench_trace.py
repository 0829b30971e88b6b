"""Read-out cost: gatelens.trace (every gate kept), anchored and step, / the module's forward.

Both run under no_grad on the same one-hot input in the same process, interleaved
(torch, trace, torch, trace, ...) so machine noise hits both alike; each figure is the
median of the repeats after warm-up. Default thread count.

    .venv/bin/python benchmarks/bench_trace.py            # full table
    .venv/bin/python benchmarks/bench_trace.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from gatelens.readout.trace import trace

CONFIGS = [  # (label, cell class, layers, batch)
    ("lstm B=32", nn.LSTM, 1, 32),
    ("lstm B=256", nn.LSTM, 1, 256),
    ("gru B=32", nn.GRU, 1, 32),
    ("lstm 2-layer B=32", nn.LSTM, 2, 32),
]


def one_hot_input(B: int, T: int, V: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, V, (B, T), generator=g)
    return nn.functional.one_hot(idx, V).float()  # (B, T, V)


def measure(module: nn.Module, x: torch.Tensor, repeats: int,
            warmup: int) -> tuple[float, float, float]:
    """Median seconds of the module's forward, trace(anchored) and trace(step), interleaved."""
    def forward() -> None:
        with torch.no_grad():
            module(x)

    fns = (forward, lambda: trace(module, x, method="anchored"),
           lambda: trace(module, x, method="step"))
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[], [], []]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return tuple(statistics.median(t) for t in times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("-T", type=int, default=128)
    ap.add_argument("-H", "--hidden", type=int, default=325)
    ap.add_argument("-V", "--vocab", type=int, default=85)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for both (0: leave PyTorch's default)")
    ap.add_argument("--only", default="", help="run only configs whose label contains this")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    T, H, V, repeats, warmup = args.T, args.hidden, args.vocab, args.repeats, 3
    if args.quick:
        T, H, repeats, warmup = 16, 32, 3, 1
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, T={T} H={H} V={V}, "
          f"median of {repeats}")
    print(f"{'config':<20} {'torch ms':>9} {'anchored':>9} {'ratio':>6} {'step ms':>9} "
          f"{'ratio':>6}")
    for label, cls, layers, B in CONFIGS:
        if args.only not in label:
            continue
        module = cls(V, H, num_layers=layers, batch_first=True).eval()
        x = one_hot_input(B, T, V)
        t_mod, t_an, t_st = measure(module, x, repeats, warmup)
        print(f"{label:<20} {t_mod * 1e3:9.2f} {t_an * 1e3:9.2f} {t_an / t_mod:6.2f} "
              f"{t_st * 1e3:9.2f} {t_st / t_mod:6.2f}")


if __name__ == "__main__":
    main()
