"""Modern cells: training step time against the LSTM at matched parameter counts, and the
parallel scan's speed-up over the sequential step.

    python benchmarks/bench_modern.py            # LSTM H 128, V 65, B 32, T 128
    python benchmarks/bench_modern.py --quick    # smaller, for a smoke run

Each cell's hidden size is the one whose CharLM parameter count is closest to the LSTM's.
A training step is forward, cross-entropy, backward and an Adam step; the figure is the
median over the timed steps after warm-up. The scan figures time minGRU's and minLSTM's
module forward + backward with ``run(parallel=True)`` against ``run(parallel=False)``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gatelens.model import CharLM


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def matched_hidden(cell: str, target: int, vocab: int, layers: int) -> int:
    """The hidden size whose CharLM has the parameter count closest to ``target``."""
    best, best_gap = 2, None
    for H in range(2, 1025, 2):
        gap = abs(n_params(CharLM(vocab, H, layers, cell=cell)) - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = H, gap
    return best


def step_time(model: CharLM, B: int, T: int, steps: int, warm: int = 2) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    ids = torch.randint(0, model.vocab_size, (B, T + 1))
    times = []
    for k in range(warm + steps):
        t0 = time.perf_counter()
        logits, _ = model(ids[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, model.vocab_size), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if k >= warm:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scan_time(cell: str, H: int, B: int, T: int, parallel: bool, reps: int) -> float:
    model = CharLM(65, H, 1, cell=cell).rnn
    x = torch.randn(B, T, 65)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        out, _, _ = model.run(x, parallel=parallel)
        out.sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    V, B, T, H, steps = (65, 8, 64, 48, 3) if args.quick else (65, 32, 128, 128, 10)
    torch.manual_seed(0)
    target = n_params(CharLM(V, H, 1, cell="lstm"))
    print(f"training step, B {B}, T {T}, V {V}, one layer; LSTM H {H}: {target} parameters")
    base = None
    for cell in ("lstm", "gru", "mingru", "minlstm", "slstm"):
        h = H if cell == "lstm" else matched_hidden(cell, target, V, 1)
        model = CharLM(V, h, 1, cell=cell)
        t = step_time(model, B, T, steps)
        base = base or t
        print(f"  {cell:8s} H {h:4d}  {n_params(model):7d} params  {1e3 * t:8.1f} ms/step  "
              f"x{t / base:5.2f} of the LSTM")
    print(f"parallel scan vs sequential step (module forward + backward, B {B}, H {H})")
    for cell in ("mingru", "minlstm"):
        for T_ in (128, 512):
            seq = scan_time(cell, H, B, T_, False, 3)
            par = scan_time(cell, H, B, T_, True, 3)
            print(f"  {cell:8s} T {T_:4d}  sequential {1e3 * seq:8.1f} ms  parallel "
                  f"{1e3 * par:7.1f} ms  speed-up x{seq / par:5.1f}")


if __name__ == "__main__":
    main()
