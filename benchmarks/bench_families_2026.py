"""The 2026 families side by side: the cost of reading every per-token state against the
model's own forward, in one process, and each family's one-step error.

Every model is a transformers model built from its config with random weights (the
package's own initialisation), two recurrent layers of width --hidden (attention or MLP
layers where the architecture puts them), run on B windows of T tokens in float32 on the
CPU. Timed (the best of --repeats, CPU seconds of this process, ``time.process_time``):

- the model's forward, and the same forward inside ``open_cells`` (the model runs, then
  each opened module's reference re-runs that module: its whole-sequence forward with the
  states replayed from it where the family reads them so, else its decode path one token
  at a time; then the module's own values, or the anchored float64 read of its hand cell);
- each opened module's own forward on its input, and ``gatelens.trace`` of that module
  (what the issue's "trace ≤ 2× the forward" asks of), summed over the opened modules.

RWKV-7 has its own script (bench_rwkv7.py: the package builds its model from a checkpoint
file).

    python benchmarks/bench_families_2026.py --hidden 256 --length 128
"""

from __future__ import annotations

import argparse
import warnings

import torch

from timing import best_cpu


def models(d: int, V: int) -> dict:
    """name -> a function building (the model, the family name it should open)."""
    import transformers as tf

    heads = max(d // 64, 2)
    return {
        "hf-mamba (reference)": lambda: tf.MambaForCausalLM(tf.MambaConfig(
            vocab_size=V, hidden_size=d, num_hidden_layers=2, state_size=16, conv_kernel=4)),
        "hf-falcon-mamba": lambda: tf.FalconMambaForCausalLM(tf.FalconMambaConfig(
            vocab_size=V, hidden_size=d, num_hidden_layers=2, state_size=16, conv_kernel=4)),
        "hf-jamba": lambda: tf.JambaForCausalLM(tf.JambaConfig(
            vocab_size=V, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=3,
            num_attention_heads=heads, num_key_value_heads=1, num_experts=1,
            attn_layer_period=3, attn_layer_offset=1, mamba_d_state=16, mamba_d_conv=4,
            use_cache=False)),
        "hf-mamba2-mixer (Bamba)": lambda: tf.BambaForCausalLM(tf.BambaConfig(
            vocab_size=V, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=3,
            attn_layer_indices=[1], num_attention_heads=heads, num_key_value_heads=1,
            mamba_n_heads=heads, mamba_d_head=2 * d // heads, mamba_d_state=64,
            mamba_d_conv=4, mamba_chunk_size=64)),
        "hf-gated-deltanet (Qwen3-Next)": lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(
            vocab_size=V, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=3,
            num_attention_heads=heads, num_key_value_heads=1, head_dim=64,
            linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
            num_experts=0, layer_types=["linear_attention", "full_attention",
                                        "linear_attention"])),
        "hf-kda (Kimi-Linear)": lambda: tf.KimiLinearForCausalLM(tf.KimiLinearConfig(
            vocab_size=V, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=3,
            num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
            linear_num_heads=heads, linear_head_dim=64, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense"] * 3, pad_token_id=0, use_cache=False)),
        "hf-rglru (RecurrentGemma)": lambda: tf.RecurrentGemmaForCausalLM(
            tf.RecurrentGemmaConfig(
                vocab_size=V, hidden_size=d, intermediate_size=3 * d, num_hidden_layers=3,
                num_attention_heads=heads, block_types=("recurrent", "attention",
                                                        "recurrent"),
                attention_window_size=64, use_cache=False, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)),
        "hf-xlstm": lambda: tf.xLSTMForCausalLM(tf.xLSTMConfig(
            vocab_size=V, hidden_size=d, num_hidden_layers=2, num_heads=heads,
            use_cache=False)),
    }


def measure(model, ids, repeats: int) -> dict:
    """The model's forward and ``open_cells`` seconds, the opened modules' own forwards and
    traces (summed), how many modules were opened, how they were read, the worst one-step."""
    import gatelens
    from gatelens.readout.hooks import open_cells

    with torch.no_grad():
        forward = best_cpu(lambda: model(ids, use_cache=False), repeats)

        def traced():
            with open_cells(model) as cache:
                model(ids, use_cache=False)
            return cache

        whole = best_cpu(traced, repeats)
        methods = sorted({t[0].meta.get("method") for t in traced().traces.values()})
    lens = gatelens.Lens(model, vocab=int(model.config.vocab_size))
    worst, own, trace = 0.0, 0.0, 0.0
    for fam in lens.families.values():
        feats = {}

        def grab(mod, a, kw, out, feats=feats):
            feats["x"] = a[0] if a else next(iter(kw.values()))
        h = fam.module.register_forward_hook(grab, with_kwargs=True)
        with torch.no_grad():
            model(ids, use_cache=False)
        h.remove()
        call = fam.check(feats["x"])
        with torch.no_grad():
            own += best_cpu(lambda fam=fam, call=call: fam._forward(call), repeats)
            trace += best_cpu(lambda fam=fam, x=feats["x"]: gatelens.trace(fam.module, x), repeats)
        ref = fam.reference(call)
        worst = max([worst] + [r.max_scaled_diff_h for r in fam.one_step(call, ref)])
    return {"forward": forward, "whole": whole, "n": len(lens.families), "worst": worst,
            "own": own, "trace": trace, "method": "/".join(methods)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="names containing this text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    V = 256
    print(f"hidden {args.hidden}, B = {args.batch}, T = {args.length}, float32, "
          f"{args.threads} threads; CPU seconds, best of {args.repeats}")
    print(f"{'family':34s} {'layers':>6s} {'forward':>8s} {'traced':>8s} {'ratio':>6s} "
          f"{'module':>8s} {'trace':>8s} {'ratio':>6s} {'read':>8s} {'one-step':>9s}")
    for name, build in models(args.hidden, V).items():
        if args.only not in name:
            continue
        torch.manual_seed(0)
        model = build().eval()
        ids = torch.randint(0, V, (args.batch, args.length),
                            generator=torch.Generator().manual_seed(1))
        r = measure(model, ids, args.repeats)
        print(f"{name:34s} {r['n']:6d} {r['forward']:8.3f} {r['whole']:8.3f} "
              f"{r['whole'] / r['forward']:6.1f} {r['own']:8.3f} {r['trace']:8.3f} "
              f"{r['trace'] / r['own']:6.1f} {r['method']:>8s} {r['worst']:9.2e}", flush=True)


if __name__ == "__main__":
    main()
