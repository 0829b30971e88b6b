"""The 2026 families side by side: the cost of reading every per-token state (the whole
model under ``open_cells``) against the model's own forward, in one process, and each
family's one-step error.

Every model is a transformers model built from its config with random weights (the
package's own initialisation), two recurrent layers of width --hidden (attention or MLP
layers where the architecture puts them), run on B windows of T tokens in float32 on the
CPU. Timed: the best of --repeats of the model's forward, and of the same forward inside
``open_cells`` (each recurrent layer's reference: its decode path one token at a time,
its prompt path, and the anchored float64 read of its hand cell). The ratio is what the
issue's "trace ≤ 2× the forward" asks of; RWKV-7 has its own script (bench_rwkv7.py: the
package builds its model from a checkpoint file).

    python benchmarks/bench_families_2026.py --hidden 256 --length 128
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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


def measure(model, ids, repeats: int) -> tuple[float, float, int, float]:
    """(forward seconds, traced seconds, recurrent layers opened, worst one-step error)."""
    import gatelens
    from gatelens.readout.hooks import open_cells

    with torch.no_grad():
        forward = _best(lambda: model(ids, use_cache=False), repeats)

        def traced():
            with open_cells(model) as cache:
                model(ids, use_cache=False)
            return cache

        whole = _best(traced, repeats)
    lens = gatelens.Lens(model, vocab=int(model.config.vocab_size))
    worst = 0.0
    for fam in lens.families.values():
        feats = {}

        def grab(mod, a, kw, out, feats=feats):
            feats["x"] = a[0] if a else next(iter(kw.values()))
        h = fam.module.register_forward_hook(grab, with_kwargs=True)
        with torch.no_grad():
            model(ids, use_cache=False)
        h.remove()
        call = fam.check(feats["x"])
        ref = fam.reference(call)
        worst = max([worst] + [r.max_scaled_diff_h for r in fam.one_step(call, ref)])
    return forward, whole, len(lens.families), worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="names containing this text")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    V = 256
    print(f"hidden {args.hidden}, B = {args.batch}, T = {args.length}, float32, "
          f"{args.threads} threads; best of {args.repeats}")
    print(f"{'family':34s} {'layers':>6s} {'forward s':>10s} {'traced s':>9s} "
          f"{'ratio':>6s} {'one-step':>9s}")
    for name, build in models(args.hidden, V).items():
        if args.only not in name:
            continue
        torch.manual_seed(0)
        model = build().eval()
        ids = torch.randint(0, V, (args.batch, args.length),
                            generator=torch.Generator().manual_seed(1))
        forward, whole, n, worst = measure(model, ids, args.repeats)
        print(f"{name:34s} {n:6d} {forward:10.3f} {whole:9.3f} "
              f"{whole / forward:6.1f} {worst:9.2e}", flush=True)


if __name__ == "__main__":
    main()
