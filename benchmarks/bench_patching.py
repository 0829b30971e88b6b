"""The cost of edited runs and of an activation-patching sweep, as multiples of the model's
own forward (issue 28, "Numbers to reach").

The seed's model (gatelens's CharLM: one-hot input, one nn.LSTM layer of 325 units, a
linear head over 85 characters; untrained weights, which cost the same), B = 32 windows of
T = 128:

- one edited run that reads only the output (what a sweep runs: the kernel to the edit,
  the cell's step with the edit, the kernel after), early and late in the window, and the
  same started at the edit from the unedited run's state (``run_edits(start=)``, what a
  sweep's runs do); ``Lens.run`` with its full trace, no edit and edited (forget gate set
  to 1 on 96 steps);
- ``gatelens.patch_sweep`` of ``rnn.layer0.c`` and ``rnn.layer0.h`` at every position
  (256 patched runs; the corrupt windows differ from the clean ones in T/8 characters from
  T/4) and attribution patching (one backward pass). The issue's target: <= 60 s.

``--mamba``: a Mamba-shaped model (transformers' MambaForCausalLM at mamba-130m's config:
24 layers of 768, state 16, vocabulary 50,280; random weights, ~130M parameters), B = 1
window of T = 128 tokens: the lean edited run at three positions (the module's own
prefill to the edit, its hand cell from there). Every time is the median of interleaved
repeats, beside a forward timed in the same loop.

    .venv/bin/python benchmarks/bench_patching.py            # the LSTM and the sweep
    .venv/bin/python benchmarks/bench_patching.py --mamba    # the Mamba-shaped model
    .venv/bin/python benchmarks/bench_patching.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import gatelens
from gatelens.interventions.run import run_edits
from gatelens.training.model import CharLM


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ratios(forward: Callable[[], object], runs: dict[str, Callable[[], object]],
           repeats: int) -> tuple[float, dict[str, float]]:
    """The median forward and each run's median as a multiple of it, interleaved (a
    forward before each run) so that a change of load falls on both."""
    fwd: list[float] = []
    got: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            fwd.append(_timed(forward))
            got[name].append(_timed(fn))
    f = statistics.median(fwd)
    return f, {k: statistics.median(v) / f for k, v in got.items()}


def lstm(args: argparse.Namespace) -> None:
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
          f"V={V}, B={B} T={T}")
    c = lens.run(clean).trace["rnn.layer0.c"]
    bad = lens.run(corrupt).trace

    def lean(t: int, start: bool = False) -> Callable[[], object]:
        return lambda: run_edits(lens, corrupt, [gatelens.Set("rnn.layer0.c", c[:, t], at=t)],
                                 trace=False, start=bad if start else None)

    def traced(edits: list) -> Callable[[], object]:
        return lambda: lens.run(corrupt, edits)

    def forward() -> None:
        with torch.no_grad():
            model(corrupt)

    f, r = ratios(forward, {
        "lean, edit at t=1": lean(1), f"lean, edit at t={T // 2}": lean(T // 2),
        f"lean, edit at t={T - 2}": lean(T - 2),
        "lean from the run's state, t=1": lean(1, True),
        f"lean from the run's state, t={T // 2}": lean(T // 2, True),
        f"lean from the run's state, t={T - 2}": lean(T - 2, True),
        "Lens.run (trace), no edit": traced([]),
        f"Lens.run (trace), edit at t={T - 2}": traced([gatelens.Set(
            "rnn.layer0.c", c[:, T - 2], at=T - 2)]),
        f"Lens.run (trace), f := 1 on {T * 3 // 4} steps": traced([gatelens.Set(
            "rnn.layer0.f", 1.0, at=slice(T // 4, None))])}, args.repeats)
    print(f"model forward {f * 1e3:.1f} ms")
    for k, v in r.items():
        print(f"  {k:<42} {v:5.2f}x the forward")
    t0 = time.perf_counter()
    res = gatelens.patch_sweep(lens, clean, corrupt, names, metric="loss")
    total = time.perf_counter() - t0
    print(f"sweep of {len(names)} names x {T} positions with attribution patching "
          f"{total:.1f} s ({total / (len(names) * T) * 1e3:.0f} ms a cell); Spearman "
          f"{res.spearman:.3f}; max |effect| {abs(res.effect).max():.3f}")


def mamba(args: argparse.Namespace) -> None:
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    L, d, V, T = (2, 64, 1000, 16) if args.quick else (24, 768, 50280, args.T)
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=V, hidden_size=d, num_hidden_layers=L,
                                   state_size=16, expand=2, conv_kernel=4, use_cache=False)
    model = transformers.MambaForCausalLM(cfg).eval()
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    lens = gatelens.Lens(model, vocab=V)
    key = f"backbone.layer{L // 2}.s"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, MambaForCausalLM "
          f"{L} x {d}, {n / 1e6:.0f}M parameters, B=1 T={T}")

    def lean(t: int) -> Callable[[], object]:
        return lambda: run_edits(lens, ids, [gatelens.Zero(key, at=t)], trace=False)

    def forward() -> None:
        with torch.no_grad():
            model(ids, use_cache=False)

    f, r = ratios(forward, {f"lean, {key} zeroed at t={t}": lean(t)
                            for t in (1, T // 2, T - 2)}, args.repeats)
    print(f"model forward {f:.2f} s")
    for k, v in r.items():
        print(f"  {k:<42} {v:5.2f}x the forward")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--mamba", action="store_true", help="the Mamba-shaped model instead")
    ap.add_argument("-B", type=int, default=32)
    ap.add_argument("-T", type=int, default=128)
    ap.add_argument("-H", "--hidden", type=int, default=325)
    ap.add_argument("-V", "--vocab", type=int, default=85)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: leave PyTorch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    (mamba if args.mamba else lstm)(args)


if __name__ == "__main__":
    main()
