"""The divergence rate of a Mamba-1 stack two ways, in one process: its tangent carried a
layer at a time over the whole window (``Dynamics.sweep``, families/mamba_sweep.py) and
through the whole stack's step a token at a time (the step-by-step JVP), on one window of a
random transformers Mamba at mamba-130m's width: the time of each (best of --repeats) and
how far apart the two λ are. Prints one JSON line.

    python benchmarks/bench_sweep.py --layers 24 [--width 768] [--length 128]
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import replace

import torch

from timing import best_of


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers as tf

    from gatelens.analysis.divergence import rate_of
    from gatelens.families.registry import open_family

    tf.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tf.MambaModel(tf.MambaConfig(
        vocab_size=8, hidden_size=args.width, num_hidden_layers=args.layers, state_size=16,
        expand=2, use_cache=False)).eval()
    fam = open_family(model)
    call = fam.check(torch.randn(1, args.length, args.width,
                                 generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        (dyn,) = fam.dynamics(call, fam.reference(call))
    stepped = replace(dyn, sweep=None)
    got = {}
    swept_s = best_of(args.repeats, lambda: got.update(swept=rate_of([dyn])))
    stepped_s = best_of(args.repeats, lambda: got.update(stepped=rate_of([stepped])))
    a, b = got["swept"].lyapunov_per_char, got["stepped"].lyapunov_per_char
    print(json.dumps({"layers": args.layers, "width": args.width, "length": args.length,
                      "swept_s": swept_s, "stepped_s": stepped_s,
                      "ratio": stepped_s / swept_s, "lambda_swept": a,
                      "lambda_stepped": b, "apart": abs(a - b)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
