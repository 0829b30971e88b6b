"""Activation-patching sweep cost: 2 names x 128 positions on the seed-size LSTM.

The seed's model (gatelens's CharLM: one-hot input, one nn.LSTM layer of 325 units, a
linear head over 85 characters; untrained weights, which cost the same), B = 32 windows of
T = 128. ``gatelens.patch_sweep`` patches ``rnn.layer0.c`` and ``rnn.layer0.h`` at every
position (256 patched runs, each the module's own kernel up to the position, one step of
the cell's equations with the clean value, the kernel after; the corrupt windows differ
from the clean ones in T/8 characters from T/4) and then attribution patching
(one backward pass). Reported: the whole sweep's wall time (the issue's target: <= 60 s on
the 2-core CPU), its parts, and one patched run against the model's own forward.

    .venv/bin/python benchmarks/bench_patching.py            # the full sweep
    .venv/bin/python benchmarks/bench_patching.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gatelens
from gatelens.interventions.run import run_edits
from gatelens.training.model import CharLM


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("-B", type=int, default=32)
    ap.add_argument("-T", type=int, default=128)
    ap.add_argument("-H", "--hidden", type=int, default=325)
    ap.add_argument("-V", "--vocab", type=int, default=85)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: leave PyTorch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T, H, V = args.B, args.T, args.hidden, args.vocab
    if args.quick:
        B, T, H = 4, 16, 32
    torch.manual_seed(0)
    model = CharLM(V, hidden=H).eval()
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, V, (B, T), generator=g)
    corrupt = clean.clone()
    span = slice(T // 4, T // 4 + max(1, T // 8))  # an untrained model: change a stretch
    corrupt[:, span] = (clean[:, span] + 1) % V
    lens = gatelens.Lens(model)
    names = ["rnn.layer0.c", "rnn.layer0.h"]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CharLM lstm H={H} "
          f"V={V}, B={B} T={T}, {len(names)} names x {T} positions")

    def forward() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model(corrupt)
        return time.perf_counter() - t0

    def one_patch(t: int) -> float:
        v = lens.run(clean).trace["rnn.layer0.c"][:, t]
        t0 = time.perf_counter()
        run_edits(lens, corrupt, [gatelens.Set("rnn.layer0.c", v, at=t)], trace=False)
        return time.perf_counter() - t0

    forward(), one_patch(T // 2)  # warm-up
    fwd = statistics.median(forward() for _ in range(5))
    early = statistics.median(one_patch(1) for _ in range(5))
    late = statistics.median(one_patch(T - 2) for _ in range(5))
    print(f"model forward {fwd * 1e3:.1f} ms; one patched run at t=1 {early * 1e3:.1f} ms "
          f"({early / fwd:.2f}x), at t=T-2 {late * 1e3:.1f} ms ({late / fwd:.2f}x)")
    t0 = time.perf_counter()
    res = gatelens.patch_sweep(lens, clean, corrupt, names, metric="loss")
    total = time.perf_counter() - t0
    t0 = time.perf_counter()
    gatelens.patch_sweep(lens, clean, corrupt, names, positions=[0, T - 1], metric="loss")
    bound = time.perf_counter() - t0 - (early + late) * len(names)
    print(f"sweep with attribution patching {total:.1f} s ({total / (len(names) * T) * 1e3:.0f}"
          f" ms a cell); the attribution's backward pass and the two traced runs at most "
          f"{max(bound, 0):.1f} s (a 2-position sweep less its patched runs); Spearman "
          f"{res.spearman:.3f}; max |effect| {abs(res.effect).max():.3f}")

if __name__ == "__main__":
    main()
