"""Real size: each stage of the default analysis as a multiple of the model's own forward,
and the peak memory, on random models at the configurations researchers study.

Each model runs in a fresh process (its peak resident memory, ru_maxrss, is its own):
built from its config with random weights (transformers' own initialisation; the LSTM is
PyTorch's), float32 on the CPU, W windows of T random tokens. Timed in that process: the
model's forward on the windows (after one warm-up call), the same forward under
``open_cells`` (every per-token state of every layer), ``gatelens.trace`` and
``gatelens.verify`` of the recurrent module on what it received, and ``Lens.measure`` of the
windows with the default settings (exponents "auto": the spectrum's cost rule), stage by
stage.

    python benchmarks/bench_real_size.py [--only mamba] [--layers 24] [--windows 8]
        [--length 128] [--timeout 1800] [--read-out-only]

``--layers`` cuts every stack to that depth (default: each model's own); the ratios are
per stage, so a cut stack still says what each stage costs against its forward.
``--read-out-only`` stops after ``trace`` and ``verify`` (no analysis): the read-out's cost
at a depth and window count the whole analysis would take too long for. It then times the
forward and ``trace`` once more: after the read-outs' large tensors came and went, glibc
serves a forward's large temporaries from its heap instead of fresh pages, and the same
forward can take half the time; both ratios are printed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

import torch
from torch import nn

from timing import best_of


class WordLSTM(nn.Module):
    """The PTB "large" word model's shape: Embedding(10k, 1500), 2 × 1,500 LSTM, Linear."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(10_000, 1_500)
        self.lstm = nn.LSTM(1_500, 1_500, num_layers=layers, batch_first=True)
        self.head = nn.Linear(1_500, 10_000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def build(name: str, layers: int | None) -> tuple[nn.Module, int, str]:
    """(the model, its vocabulary size, its configuration in words)."""
    import transformers as tf

    if name == "mamba-130m":
        n = layers or 24
        cfg = tf.MambaConfig(vocab_size=50_280, hidden_size=768, num_hidden_layers=n,
                             state_size=16, conv_kernel=4, expand=2, use_cache=False)
        return tf.MambaForCausalLM(cfg), 50_280, f"Mamba {n} x 768, d_state 16"
    if name == "mamba2-130m":
        n = layers or 24
        cfg = tf.Mamba2Config(vocab_size=50_288, hidden_size=768, num_hidden_layers=n,
                              state_size=128, num_heads=24, head_dim=64, expand=2,
                              n_groups=1, conv_kernel=4, chunk_size=256, use_cache=False)
        return tf.Mamba2ForCausalLM(cfg), 50_288, f"Mamba-2 {n} x 768, 24 heads x 64 x 128"
    if name == "rwkv4-169m":
        n = layers or 12
        cfg = tf.RwkvConfig(vocab_size=50_277, hidden_size=768, num_hidden_layers=n,
                            attention_hidden_size=768, intermediate_size=3_072,
                            context_length=1_024, use_cache=False)
        return tf.RwkvForCausalLM(cfg), 50_277, f"RWKV-4 {n} x 768"
    if name == "ptb-large-lstm":
        n = layers or 2
        return WordLSTM(n), 10_000, f"LSTM {n} x 1,500, vocab 10k"
    raise SystemExit(f"unknown model {name!r}")


MODELS = ["mamba-130m", "mamba2-130m", "rwkv4-169m", "ptb-large-lstm"]


def child(name: str, layers: int | None, windows: int, length: int, read_out_only: bool = False
          ) -> None:
    """In the child process: the timings and peak memory of one model, as one JSON line."""
    import gatelens
    from gatelens.readout.hooks import open_cells

    torch.manual_seed(0)
    model, V, words = build(name, layers)
    model.eval()
    ids = torch.randint(0, V, (windows, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:1, :8])  # warm-up
        forward = best_of(3, lambda: model(ids))
        t0 = time.perf_counter()
        with open_cells(model):
            model(ids)
        traced = time.perf_counter() - t0
    lens = gatelens.Lens(model, vocab=V)
    (path,) = list(lens.families)[:1]
    module = lens.families[path].module
    seen = lens.runner(path)(ids)  # what the recurrent module itself received
    trace_s = best_of(2, lambda: gatelens.trace(module, seen.inputs, seen.state))
    t0 = time.perf_counter()
    gatelens.verify(module, seen.inputs, seen.state)
    verify_s = time.perf_counter() - t0
    read_out = {"model": name, "config": words, "forward_s": forward,
                "open_cells_x": traced / forward, "trace_x": trace_s / forward,
                "verify_x": verify_s / forward}
    if read_out_only:
        # the forward again, after the read-outs' large tensors came and went: glibc then
        # serves the forward's own large temporaries from its heap instead of mapping fresh
        # pages, and the same forward can take half the time (so trace's ratio doubles)
        with torch.no_grad():
            after = best_of(3, lambda: model(ids))
        trace_after = best_of(2, lambda: gatelens.trace(module, seen.inputs, seen.state))
        print(json.dumps({**read_out, "forward_after_s": after,
                          "trace_after_x": trace_after / after,
                          "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
        return
    clock: dict[str, float] = {}
    t0 = time.perf_counter()
    a = lens.measure(path, ids, [f"<{i}>" for i in range(V)], perturb_pos=min(32, length // 4),
                     timings=clock)
    total = time.perf_counter() - t0
    ly = a.lyapunov
    print(json.dumps({
        **read_out, "windows": windows, "length": length, "analysis_s": total,
        "analysis_x": total / forward,
        "stages_x": {k: v / forward for k, v in clock.items() if v},
        "spectrum": None if ly is None else {"k": ly.k, "windows": ly.windows,
                                             "size": ly.size, "rule": ly.rule},
        "verification": None if a.verification is None else a.verification.explain(),
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="models whose name contains this text")
    ap.add_argument("--layers", type=int, default=None, help="cut every stack to this depth")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per model")
    ap.add_argument("--read-out-only", action="store_true",
                    help="time the forward, open_cells, trace and verify only (no analysis)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.child:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        child(args.child, args.layers, args.windows, args.length, args.read_out_only)
        return 0
    print(f"W = {args.windows} windows x T = {args.length} tokens, float32, CPU, "
          f"{torch.get_num_threads()} threads; ratios to the model's own forward")
    for name in [m for m in MODELS if args.only in m]:
        cmd = [sys.executable, __file__, "--child", name, "--windows", str(args.windows),
               "--length", str(args.length)] + (["--layers", str(args.layers)]
                                                if args.layers else []) + (
            ["--read-out-only"] if args.read_out_only else [])
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: did not finish in {args.timeout:.0f} s", flush=True)
            continue
        if done.returncode != 0:
            print(f"{name}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        if args.read_out_only:
            print(f"{r['config']}: forward {r['forward_s']:.2f} s; open_cells "
                  f"{r['open_cells_x']:.1f}x; trace {r['trace_x']:.1f}x; verify "
                  f"{r['verify_x']:.1f}x; peak {r['peak_gb']:.2f} GiB; then forward "
                  f"{r['forward_after_s']:.2f} s, trace {r['trace_after_x']:.1f}x",
                  flush=True)
            continue
        stages = ", ".join(f"{k} {v:.1f}x" for k, v in r["stages_x"].items())
        print(f"{r['config']}: forward {r['forward_s']:.2f} s; open_cells {r['open_cells_x']:.1f}x;"
              f" trace {r['trace_x']:.1f}x; verify {r['verify_x']:.1f}x;"
              f" analysis {r['analysis_s']:.0f} s = {r['analysis_x']:.0f}x ({stages}); "
              f"spectrum {r['spectrum']}; verification {r['verification']}; "
              f"peak {r['peak_gb']:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
