"""Issue 27's goal at depth: the default ``Lens.measure`` of W windows × 128 tokens of an
L-layer mamba-130m-shaped model (transformers' Mamba, random weights), its time as a multiple
of the model's own forward on the same windows (best of 2, in the same process) and the
process's peak resident memory. Prints one JSON line.

    python benchmarks/bench_depth.py --layers 24 --windows 8     # issue 27's 24 × 8
    python benchmarks/bench_depth.py --kind mamba2 --windows 2   # mamba2-130m's, B = 2
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import warnings

import torch

import gatelens
from timing import best_of

VOCAB = 50_280  # mamba-130m's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--kind", choices=("mamba", "mamba2"), default="mamba",
                    help="mamba-130m's shape (Mamba-1) or mamba2-130m's (Mamba-2)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers as tf

    tf.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    if args.kind == "mamba2":  # 24 heads of 64, d_state 128, one group
        model = tf.Mamba2ForCausalLM(tf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=768, num_hidden_layers=args.layers, state_size=128,
            head_dim=64, num_heads=24, expand=2, n_groups=1, conv_kernel=4,
            use_cache=False)).eval()
    else:
        model = tf.MambaForCausalLM(tf.MambaConfig(
            vocab_size=VOCAB, hidden_size=768, num_hidden_layers=args.layers, state_size=16,
            conv_kernel=4, expand=2, use_cache=False)).eval()
    ids = torch.randint(0, VOCAB, (args.windows, args.length),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:1, :8])  # warm-up
        forward = best_of(2, lambda: model(ids))
    lens = gatelens.Lens(model, vocab=VOCAB)
    (path,) = list(lens.families)[:1]
    clock: dict[str, float] = {}
    t0 = time.perf_counter()
    a = lens.measure(path, ids, [f"<{i}>" for i in range(VOCAB)],
                     perturb_pos=min(32, args.length // 4), timings=clock, progress=True)
    total = time.perf_counter() - t0
    print(json.dumps({
        "kind": args.kind, "layers": args.layers, "windows": args.windows, "length": args.length,
        "forward_s": forward, "analysis_s": total, "analysis_x": total / forward,
        "stages_x": {k: round(v / forward, 1) for k, v in clock.items() if v},
        "passed": None if a.verification is None else a.verification.passed,
        "spectrum": None if a.lyapunov is None else {"k": a.lyapunov.k,
                                                      "windows": a.lyapunov.windows},
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
