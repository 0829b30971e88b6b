"""``gatelens verify --model`` at depth: verifying every recurrent layer of a hybrid, as a
multiple of the model's own forward, in one process.

The model is a transformers Qwen3-Next hybrid built from its config with random weights
(three Gated DeltaNet layers to one full-attention layer, as Qwen3-Next and Qwen3.5 stack
them), --layers deep and --hidden wide, float32 on the CPU, on B windows of T random
tokens. Timed, each the median of --rounds interleaved rounds (wall seconds): the model's
forward, and ``verify_modules`` (what ``gatelens verify --model`` runs) of every Gated
DeltaNet layer. Also printed: the verify time per recurrent layer, as a multiple of the
forward's share of one layer (the forward / the number of layers).

    python benchmarks/bench_verify_model.py [--layers 12] [--hidden 256] [--length 128]
"""

from __future__ import annotations

import argparse
import warnings

import torch

from timing import interleaved


def hybrid(layers: int, d: int, vocab: int) -> torch.nn.Module:
    """A random Qwen3-Next stack: full attention every fourth layer, Gated DeltaNet else."""
    import transformers as tf

    heads = max(d // 64, 2)
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    cfg = tf.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=64,
        linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=0, layer_types=types)
    return tf.Qwen3NextForCausalLM(cfg).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    from gatelens.loaders.hf_verify import verify_modules

    torch.manual_seed(0)
    model = hybrid(args.layers, args.hidden, args.vocab)
    ids = torch.randint(0, args.vocab, (args.windows, args.length),
                        generator=torch.Generator().manual_seed(1))
    verdicts: list[bool] = []

    def forward() -> None:
        with torch.no_grad():
            model(ids, use_cache=False)

    def verify_all() -> None:
        verdicts[:] = [res.passed for _, res in verify_modules(model, ids, vocab=args.vocab)]

    forward()  # warm-up
    t = interleaved({"forward": forward, "verify": verify_all}, args.rounds)
    n = len(verdicts)
    print(f"Qwen3-Next {args.layers} x {args.hidden} ({n} Gated DeltaNet layers), "
          f"B = {args.windows}, T = {args.length}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} rounds")
    print(f"  forward {t['forward']:.2f} s; verify --model {t['verify']:.2f} s = "
          f"{t['verify'] / t['forward']:.1f}x the forward, "
          f"{t['verify'] / n / (t['forward'] / args.layers):.1f}x a layer's share a layer; "
          f"{sum(verdicts)}/{n} passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
