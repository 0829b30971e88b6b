"""Cost of the memory-by-direction measurements at the seed's size, / nn.LSTM's forward.

LSTM 325 units, one-hot V = 84, B = 32 windows × T = 128 (random weights, or a trained run's
with ``--run DIR``): the divergence rate (today's, and the spectrum's k = 1), the Lyapunov
spectrum at k = 64 and k = all (650), the fixed-point search (5 most frequent characters and
the zero input held, 256 starts each) and the truncation curve (d = 1 … 64), each once,
timed after one warm-up of torch.func, and as a ratio to the median nn.LSTM forward (no_grad)
of the same batch.

    .venv/bin/python benchmarks/bench_memory.py [--threads N] [--run DIR] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from gatelens.analysis.context import context_used
from gatelens.analysis.divergence import rate_of
from gatelens.analysis.fixed_points import dynamics_fixed_points, held_inputs
from gatelens.analysis.spectrum import divergence_of, lyapunov_spectrum
from gatelens.cells.numerics import faithful_matmul
from gatelens.families.registry import open_family


def model_and_windows(args) -> tuple[nn.Module, nn.Module, torch.Tensor, list[str]]:
    """(the recurrent module, the model ids -> logits, windows (B, T), the vocabulary)."""
    if args.run:
        from gatelens.training.runs import load_run, run_windows

        run = load_run(args.run)
        ids, _ = run_windows(run, windows=args.batch, length=args.length)
        return run.model.rnn, run.model, ids, list(run.vocab.chars)
    torch.manual_seed(0)
    V = 84

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(V, args.hidden, batch_first=True)
            self.head = nn.Linear(args.hidden, V)

        def forward(self, ids):
            return self.head(self.rnn(nn.functional.one_hot(ids, V).float())[0]), None

    model = Model().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (args.batch, args.length), generator=g)
    return model.rnn, model, ids, [chr(32 + i) for i in range(V)]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the default)")
    ap.add_argument("--run", help="a run directory (its trained model and validation windows)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--skip-all", action="store_true", help="leave out k = all")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.hidden, args.batch, args.length = (16, 4, 32) if args.quick else (325, 32, 128)
    rnn, model, ids, chars = model_and_windows(args)
    V = len(chars)
    x = nn.functional.one_hot(ids, V).to(rnn.weight_ih_l0.dtype)  # (B, T, V)

    def forward() -> None:
        with torch.no_grad():
            rnn(x)

    for _ in range(3):
        forward()
    fwd = statistics.median(timed(forward)[1] for _ in range(11))
    fam = open_family(rnn)
    call = fam.check(x)
    with torch.no_grad(), faithful_matmul(x.device):
        (dyn, t_dyn) = timed(lambda: fam.dynamics(call, fam.reference(call)))
    divergence_of([_tail(d, 2) for d in dyn], burn_in=0)  # warm torch.func up (one-time ~5 s)
    rows = [("nn.LSTM forward (median of 11)", fwd), ("reference + dynamics", t_dyn)]
    ref, t = timed(lambda: rate_of(dyn))
    rows.append(("divergence rate (analysis.divergence.rate_of)", t))
    k1, t = timed(lambda: divergence_of(dyn))
    rows.append(("divergence rate as the spectrum's k = 1", t))
    sp, t = timed(lambda: lyapunov_spectrum(dyn, k=64, hidden=fam.hidden_size))
    rows.append((f"spectrum k = {sp.k}", t))
    if not args.skip_all:
        spa, t = timed(lambda: lyapunov_spectrum(dyn, k="all", hidden=fam.hidden_size))
        rows.append((f"spectrum k = all ({spa.k})", t))
    held = held_inputs(dyn[0], ids, chars)
    fp, t = timed(lambda: dynamics_fixed_points(dyn[0], held))
    rows.append((f"fixed points ({len(held)} held inputs × 256 starts)", t))

    def logits_of(i):
        return model(i)[0]

    ctx, t = timed(lambda: context_used(logits_of, ids))
    rows.append((f"truncation curve (d = {ctx.lengths[0]} … {ctx.lengths[-1]})", t))
    what = f"run {args.run}" if args.run else "random weights"
    print(f"threads {torch.get_num_threads()}, B = {args.batch}, T = {args.length}, "
          f"H = {fam.hidden_size}, S = {dyn[0].size}, {what}")
    print("| measurement | seconds | / forward |\n|---|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec:.3g} | {sec / fwd:.3g} |")
    print(f"λ_1: rate_of {ref.lyapunov_per_char:.12g}, k = 1 {k1.lyapunov_per_char:.12g}, "
          f"k = 64 {sp.exponents[0]:.12g}")
    if not args.skip_all:
        print(f"k = all: Σλ = {spa.sum:.12g}, mean ln|det J| = {spa.mean_log_abs_det:.12g}, "
              f"slow modes {len(spa.slow_modes)}")
    print(f"slow modes (k = 64): {len(sp.slow_modes)}; {sp.describe()}")
    print(fp.describe())
    print(ctx.describe())


def _tail(d, n):
    """The first n steps of a Dynamics (a cheap warm-up)."""
    from dataclasses import replace

    return replace(d, order=d.order[:n])


if __name__ == "__main__":
    main()
