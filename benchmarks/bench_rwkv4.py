"""transformers' RWKV-4 at rwkv-4-169m's config: ``trace`` read from one forward against the
decode path, as multiples of the backbone's own forward, and the two references' states
against each other.

Random weights (transformers' own initialisation), float32 on the CPU, W windows of T random
tokens. Timed in one process, each the best of a few calls: the backbone's forward
(``RwkvModel``, and the whole ``RwkvForCausalLM`` with its 50k-token head, for
bench_real_size.py's ratios), ``gatelens.trace`` of the backbone (its default, the states
read from the forward: families/rwkv4_scan.py), the same forward under ``open_cells``, and
``trace`` with the family put on its decode path (T one-token calls with the state, one
window at a time: what hf-rwkv read before). Then the largest scaled gap between the two
references' carried states (float32 rounding of one-row products, not an error).

    OMP_NUM_THREADS=1 python benchmarks/bench_rwkv4.py [--layers 2] [--windows 2]
        [--length 128]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from timing import best_of


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers as tf

    import gatelens
    from gatelens.families.hf_rwkv import HFRwkvFamily
    from gatelens.families.official import scaled_diff

    tf.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.RwkvConfig(vocab_size=50_277, hidden_size=768, num_hidden_layers=args.layers,
                        attention_hidden_size=768, intermediate_size=3_072,
                        context_length=1_024, use_cache=False)
    lm = tf.RwkvForCausalLM(cfg).eval()
    m = lm.rwkv
    ids = torch.randint(0, 50_277, (args.windows, args.length),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        m(ids[:1, :8])  # warm-up
        fwd = best_of(3, lambda: m(ids))
        whole = best_of(3, lambda: lm(ids))
    own = best_of(3, lambda: gatelens.trace(m, ids))
    t0 = time.perf_counter()
    with torch.no_grad(), gatelens.open_cells(m):
        m(ids)
    cells = time.perf_counter() - t0
    fam = HFRwkvFamily(m)
    call = fam.check(ids)
    with torch.no_grad():
        ref = fam.reference(call)
        decode = fam._trajectory(call)
    gap = max(scaled_diff(p, q)[1] for k in range(args.layers)
              for p, q in zip(ref.extra["parts"][k], decode["parts"][k], strict=True))
    HFRwkvFamily.scan_modules = lambda self: None  # the decode path, as hf-rwkv read before
    steps = best_of(1, lambda: gatelens.trace(m, ids))
    print(f"RWKV-4 {args.layers} x 768, W = {args.windows} x T = {args.length}, "
          f"{torch.get_num_threads()} threads: backbone forward {fwd:.3f} s (with its head "
          f"{whole:.3f} s); trace {own / fwd:.2f}x; open_cells {cells / fwd:.2f}x; trace on "
          f"the decode path {steps / fwd:.1f}x; states forward vs decode path {gap:.1e} scaled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
