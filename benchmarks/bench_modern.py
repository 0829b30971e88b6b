"""Modern cells: training step time against the LSTM at matched parameter counts, and the
parallel scan's speed-up over the sequential step.

    python benchmarks/bench_modern.py            # the modern preset's six models (V 84)
    python benchmarks/bench_modern.py --quick    # smaller, for a smoke run

The models are the `modern` study preset's: LSTM (the reference), GRU, RNN, minGRU and
minLSTM with two layers, sLSTM with 4 heads, each at the hidden size whose CharLM parameter
count is nearest the LSTM's (``gatelens.training.model.matched_hidden``). A training step is
forward,
cross-entropy, backward and an Adam step; the figure is the median over the timed steps
after warm-up, reported as a ratio to the LSTM's in the same process (each module's
forward as it trains: on CPU minGRU/minLSTM take the sequential step). The scan figures time
minGRU's and minLSTM's module forward + backward with ``run(parallel=True)`` against
``run(parallel=False)``; above 1 the scan is the faster.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gatelens.training.model import CharLM, matched_hidden, parameter_count

#: the modern preset's models: (cell, layers, heads)
MODELS = (("lstm", 1, 1), ("gru", 1, 1), ("rnn", 1, 1), ("mingru", 2, 1), ("minlstm", 2, 1),
          ("slstm", 1, 4))


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


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
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a study trial's 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    V, B, T, H, steps = (65, 8, 64, 48, 3) if args.quick else (84, 32, 128, 325, 6)
    torch.manual_seed(0)
    target = parameter_count({"cell": "lstm", "hidden": H, "layers": 1}, V)
    print(f"training step, B {B}, T {T}, V {V}, {args.threads} thread(s); LSTM H {H}: "
          f"{target} parameters")
    base = None
    for cell, layers, heads in MODELS:
        block = {"cell": cell, "layers": layers, "heads": heads}
        h = H if cell == "lstm" else matched_hidden(block, target, V)
        model = CharLM(V, h, layers, cell=cell, heads=heads)
        t = step_time(model, B, T, steps)
        base = base or t
        print(f"  {cell:8s} H {h:4d} x {layers}  {n_params(model):7d} params  "
              f"{1e3 * t:8.1f} ms/step  x{t / base:5.2f} of the LSTM")
    Hs = 48 if args.quick else 128
    print(f"parallel scan vs sequential step (module forward + backward, B {B}, H {Hs})")
    for cell in ("mingru", "minlstm"):
        for T_ in (128, 512):
            seq = scan_time(cell, Hs, B, T_, False, 3)
            par = scan_time(cell, Hs, B, T_, True, 3)
            print(f"  {cell:8s} T {T_:4d}  sequential {1e3 * seq:8.1f} ms  parallel "
                  f"{1e3 * par:7.1f} ms  speed-up x{seq / par:5.1f}")


if __name__ == "__main__":
    main()
