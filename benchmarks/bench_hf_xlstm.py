"""transformers' xLSTM at xLSTM-7B's block width: the cost of the per-token trace against the
model's own forward, and the one-step error there.

An ``xLSTMForCausalLM`` of --blocks mLSTM blocks (default xLSTM-7B's: hidden 4096, 8 heads,
qk_dim_factor 0.5 so d_qk 256 and d_v 512, FFN 2.667 rounded to 64; the native kernels,
chunk 64; random weights at the package's initialisation with the gates' weights drawn at
1/√fan-in, which it sets at zero) on B windows of T tokens. Timed (best of --repeats, CPU
seconds of this process): the model's forward; the whole model under ``open_cells`` (every
block's states read from the user's own forward: the backend's step kernel replayed on what
its projections gave, families/xlstm_scan.py); and, for block 0, the reference (its forward
and that replay) and the anchored float64 read (the one-step check's) alone. Per block: the one-step
error against the float32 module and against its own float64 run (``verify``'s re-judge).

    OMP_NUM_THREADS=1 python benchmarks/bench_hf_xlstm.py --threads 1
"""

from __future__ import annotations

import argparse
import warnings

import torch

from timing import best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--qk", type=float, default=0.5, help="qk_dim_factor")
    ap.add_argument("--v", type=float, default=1.0, help="v_dim_factor")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--length", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    from gatelens.families.hf_xlstm import HFXLSTMFamily
    from gatelens.readout.depth import one_step_float64
    from gatelens.readout.hooks import open_cells

    transformers.utils.logging.set_verbosity_error()
    cfg = transformers.xLSTMConfig(vocab_size=64, hidden_size=args.hidden,
                                   num_hidden_layers=args.blocks, num_heads=args.heads,
                                   qk_dim_factor=args.qk, v_dim_factor=args.v)
    torch.manual_seed(0)
    model = transformers.xLSTMForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate_preact.weight" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "igate_preact.bias" in name:
                p.zero_()
    ids = torch.randint(0, 64, (args.batch, args.length), generator=g)
    fam = HFXLSTMFamily(model.backbone.blocks[0])
    with torch.no_grad():
        forward = best_cpu(lambda: model(ids), args.repeats)

        def traced():
            with open_cells(model) as cache:
                model(ids)
            return cache

        whole = best_cpu(traced, args.repeats)
        call = fam.check(model.backbone.embeddings(ids))
        reference = best_cpu(lambda: fam.reference(call), args.repeats)
        ref = fam.reference(call)
        read = best_cpu(lambda: fam.read(call, ref), args.repeats)
        rows = [HFXLSTMFamily(blk) for blk in model.backbone.blocks]
        x, figures = call.inputs, []
        for f in rows:
            c = f.check(x)
            r = f.reference(c)
            (row,) = f.one_step(c, r)
            (row64,) = one_step_float64(f, c)  # verify's re-judge where float32 says no
            figures.append((row.max_scaled_diff_h, row.max_abs_diff_h, row64.max_scaled_diff_h,
                            r.extra["step_vs_forward"][1], r.extra["final_vs_step"][1]))
            x = f.module(x, None)[0]
    NH, dqk, dv = fam.shape
    print(f"hidden={args.hidden} heads={NH} d_qk={dqk} d_v={dv} blocks={args.blocks} "
          f"B={args.batch} T={args.length} threads={args.threads}; "
          f"state {NH * (dqk * dv + dqk):,} a token and block")
    print(f"model forward        {forward:8.3f} s")
    print(f"open_cells forward   {whole:8.3f} s  ({whole / forward:.1f}x the forward)")
    print(f"block 0 reference    {reference:8.3f} s;  anchored read {read:.3f} s")
    for k, (sc, ab, sc64, svf, fin) in enumerate(figures):
        print(f"block {k}: one-step scaled {sc:.2g} (absolute {ab:.2g}), against the "
              f"module's float64 run {sc64:.2g}; prompt vs step {svf:.2g} scaled; final "
              f"state {fin:.2g} (head scale)")


if __name__ == "__main__":
    main()
