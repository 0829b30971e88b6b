"""Gated DeltaNet at Qwen3.5-0.8B's layer width: the cost of the per-token trace against the
model's own forward, and the one-step error there.

A 2-layer ``Qwen3_5ForCausalLM`` (Gated DeltaNet, then full attention; hidden 1024, 16 key
and 16 value heads of 128, conv 4; random weights, the projections at 1/√fan-in so states
are of order one) on B windows of T tokens. Timed (best of --repeats, CPU seconds of this
process): the whole model's forward and the layer's; ``gatelens.trace`` of the layer (its
chunked forward once, with hooks on its projections, and the package's recurrent step
replayed on what they returned: families/delta_scan.py); the whole model under
``open_cells`` (the user's forward itself recorded, no second run of the layer); the
decode-path reference it replaces (the layer's own decode step, T calls with transformers'
cache); the anchored read (float64, every step at once: what the one-step check runs).

    OMP_NUM_THREADS=1 python benchmarks/bench_gated_deltanet.py --threads 1

``--layers 24 --vocab 248320`` builds the whole of Qwen3.5-0.8B's shape instead (24 layers,
three Gated DeltaNet layers to one full attention, its vocabulary and tied head): then
``open_cells`` reads every Gated DeltaNet layer's states against the whole model's forward,
the head and the MLPs included (the issue's "the model's own forward").
"""

from __future__ import annotations

import argparse
import warnings

import torch

from timing import best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2, help="2: one Gated DeltaNet, one "
                    "attention; more: Qwen3.5's three to one")
    ap.add_argument("--vocab", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers
    from transformers.utils import logging

    import gatelens
    from gatelens.families.hf_gated_deltanet import HFGatedDeltaNetFamily

    logging.set_verbosity_error()
    types = ["linear_attention", "full_attention"] if args.layers == 2 else [
        "full_attention" if k % 4 == 3 else "linear_attention" for k in range(args.layers)]
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=1024, intermediate_size=3584,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=types, tie_word_embeddings=args.layers > 2)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    linear = [b.linear_attn for b in model.model.layers if hasattr(b, "linear_attn")]
    layer = linear[0]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in (kv for gdn in linear for kv in gdn.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) / 2)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=g)
    captured = {}
    hook = layer.register_forward_hook(
        lambda m, a, kw, out: captured.update(x=kw["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        model(ids, use_cache=False)
    hook.remove()
    fam = HFGatedDeltaNetFamily(layer)
    call = fam.check(captured["x"])

    def traced():
        with gatelens.open_cells(model) as cache:
            model(ids, use_cache=False)
        return cache

    with torch.no_grad():
        forward = best_cpu(lambda: model(ids, use_cache=False), args.repeats)
        own = best_cpu(lambda: fam._forward(call), args.repeats)
        trace = best_cpu(lambda: gatelens.trace(layer, captured["x"]), args.repeats)
        whole = best_cpu(traced, args.repeats)
        decode = best_cpu(lambda: fam._trajectory(call), args.repeats)
        ref = fam.reference(call)
        read = best_cpu(lambda: fam.read(call, ref), args.repeats)
        (row,) = fam.one_step(call, ref)
        held = sum(t[n].numel() * t[n].element_size() for ts in traced().traces.values()
                   for t in ts for n in t if n.endswith(".s"))
    S = fam.shape[1] * fam.shape[2] * fam.shape[3]
    print(f"{args.layers} layers ({len(linear)} Gated DeltaNet), vocabulary {args.vocab:,}; "
          f"B={args.batch} T={args.length} threads={args.threads}; state {S:,} a token and "
          f"layer, {held / 2**30:.2f} GiB of states in all; "
          f"read {ref.extra['own'] is not None and 'own' or 'decode path'}")
    print(f"model forward          {forward:8.3f} s")
    print(f"layer forward          {own:8.3f} s  ({own / forward:.2f}x the model's)")
    print(f"trace of the layer     {trace:8.3f} s  ({trace / own:.2f}x the layer's forward)")
    print(f"open_cells, the model  {whole:8.3f} s  ({whole / forward:.2f}x the model's forward)")
    print(f"decode path (before)   {decode:8.3f} s  ({decode / own:.1f}x the layer's forward)")
    print(f"anchored read          {read:8.3f} s  ({read / own:.1f}x the layer's forward)")
    print(f"one-step scaled {row.max_scaled_diff_h:.2g} (absolute {row.max_abs_diff_h:.2g}); "
          f"chunked vs step {ref.extra['step_vs_forward'][1]:.2g}; "
          f"final state {ref.extra['final_vs_step'][1]:.2g}")

if __name__ == "__main__":
    main()
