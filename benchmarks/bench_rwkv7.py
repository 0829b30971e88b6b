"""RWKV-7 (the ``rwkv`` package's ``RWKV_x070``) at RWKV-7 0.1B's width: the cost of the
per-token trace against the package's own forward, and the one-step error there.

Two layers of n_embd 768 (12 heads of 64, FFN 3072, LoRA ranks 64/64/32/128 as in the 0.1B
checkpoint), a vocabulary of 1,000; random weights, the projections at 1/√fan-in. The
checkpoint is written as a .pth of tensors in a temporary folder and built by the package
itself (strategy "cpu fp32"). Timed (best of --repeats, CPU seconds of this process) on B
windows of T ids: the package's whole-window ``forward_seq`` (full output); its one-token
``forward`` id by id; the family's reference, now one whole-window pass per layer in
forward_seq's own arithmetic (families/rwkv7_scan.py) and before the package's one-token
step per layer (``_trajectory``, kept as the independent reference); the anchored read
(float64, every step at once); the free-running re-run; and ``gatelens.trace`` in all.
Then the checks: one-step error, the pass against forward_seq (bit for bit) and against
the one-token path (scaled).

    OMP_NUM_THREADS=1 python benchmarks/bench_rwkv7.py --threads 1
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
import warnings
from pathlib import Path

import torch

from timing import best_cpu


def checkpoint(C: int, N: int, layers: int, V: int, seed: int = 0) -> dict:
    """A random RWKV-7 checkpoint in the package's names and shapes."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return scale * torch.randn(*shape, generator=g)

    z = {"emb.weight": r(V, C, scale=1.0), "blocks.0.ln0.weight": 1 + r(C, scale=0.1),
         "blocks.0.ln0.bias": r(C, scale=0.1), "ln_out.weight": 1 + r(C, scale=0.1),
         "ln_out.bias": r(C, scale=0.1), "head.weight": r(V, C, scale=C ** -0.5)}
    for i in range(layers):
        b, a, f = f"blocks.{i}.", f"blocks.{i}.att.", f"blocks.{i}.ffn."
        for n in ("ln1", "ln2"):
            z[f"{b}{n}.weight"], z[f"{b}{n}.bias"] = 1 + r(C, scale=0.1), r(C, scale=0.1)
        for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            z[a + n] = torch.rand(1, 1, C, generator=g)
        for n, rank in (("w", 64), ("a", 64), ("v", 32), ("g", 128)):
            if n == "v" and i == 0:
                continue
            if n != "g":
                z[f"{a}{n}0"] = r(1, 1, C, scale=1.0)
            z[f"{a}{n}1"], z[f"{a}{n}2"] = r(C, rank, scale=C ** -0.5), r(rank, C,
                                                                          scale=rank ** -0.5)
        z[a + "k_k"], z[a + "k_a"] = 1 + r(1, 1, C, scale=0.1), 1 + r(1, 1, C, scale=0.1)
        z[a + "r_k"] = r(C // N, N)
        for n in ("receptance", "key", "value", "output"):
            z[f"{a}{n}.weight"] = r(C, C, scale=C ** -0.5)
        z[a + "ln_x.weight"], z[a + "ln_x.bias"] = 1 + r(C, scale=0.1), r(C, scale=0.1)
        z[f + "x_k"] = torch.rand(1, 1, C, generator=g)
        z[f + "key.weight"] = r(4 * C, C, scale=C ** -0.5)
        z[f + "value.weight"] = r(C, 4 * C, scale=(4 * C) ** -0.5)
    return z


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    os.environ["RWKV_V7_ON"] = "1"  # before rwkv.model is imported: it defines RWKV_x070
    pkg = importlib.import_module("rwkv.model")
    import gatelens
    from gatelens.families.official import scaled_diff
    from gatelens.families.rwkv7 import RWKV7Family

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rwkv7"
        torch.save(checkpoint(args.width, args.head_size, 2, 1000), f"{path}.pth")
        model = pkg.RWKV_x070(str(path), "cpu fp32")
    B, T = args.batch, args.length
    ids = torch.randint(0, 1000, (B, T), generator=torch.Generator().manual_seed(1))
    fam = RWKV7Family(model)
    call = fam.check(ids)

    def seq():
        for row in ids:
            model.forward(row.tolist(), None, full_output=True)

    def one():
        for row in ids:
            state = None
            for i in row.tolist():
                _, state = model.forward(i, state)

    ref = fam.reference(call)
    with torch.no_grad():
        times = {"forward_seq (the package's forward)": best_cpu(seq, args.repeats),
                 "forward id by id (its one-token path)": best_cpu(one, args.repeats),
                 "reference: one whole-window pass per layer (now)":
                     best_cpu(lambda: fam.reference(call), args.repeats),
                 "reference: its one-token step per layer (before)":
                     best_cpu(lambda: fam._trajectory(call), args.repeats),
                 "anchored read (float64)": best_cpu(lambda: fam.read(call, ref), args.repeats),
                 "free-running re-run (float64, a pass per layer)":
                     best_cpu(lambda: fam.rerun(call), args.repeats),
                 "trace in all (method own, the default)":
                     best_cpu(lambda: gatelens.trace(model, ids), args.repeats),
                 "trace in all (method anchored)":
                     best_cpu(lambda: gatelens.trace(model, ids, method="anchored"), args.repeats)}
    base = times["forward_seq (the package's forward)"]
    print(f"RWKV-7, 2 layers, n_embd {args.width}, heads of {args.head_size}, B {B}, T {T}, "
          f"{args.threads} thread(s)")
    print("| stage | seconds | × forward_seq |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t:.3f} | {t / base:.1f} |")
    rows = fam.one_step(call, ref)
    decode = fam._trajectory(call)
    gap = max(scaled_diff(ref.states[f"layer{k}.s"], decode["parts"][k][1])[1]
              for k in range(2))
    exact = True
    for b, row in enumerate(ids):  # the pass against forward_seq, window by window
        out, state = model.forward(row.tolist(), None, full_output=True)
        exact &= torch.equal(out, ref.output[b]) and all(
            torch.equal(state[3 * k + 1].reshape(-1), ref.extra["parts"][k][1][b, -1])
            for k in range(2))
    print(f"one-step {max(r.max_scaled_diff_h for r in rows):.2g} scaled "
          f"({max(r.max_abs_diff_h for r in rows):.2g} absolute); the pass's logits and final "
          f"state are forward_seq's bit for bit: {exact}; its states against the one-token "
          f"path {gap:.2g} scaled, its logits "
          f"{scaled_diff(decode['output'], ref.output)[1]:.2g}")


if __name__ == "__main__":
    main()
