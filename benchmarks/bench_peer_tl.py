"""Beside the peer: TransformerLens's per-token Mamba-1 states (``hook_ssm_state`` with its
mixers' ``eager_scan`` on, ``run_with_cache``) and gatelens's (``open_cells`` on the user's
own forward), each against transformers' own forward of the same random model, in one
process, interleaved round by round; medians.

TransformerLens is not a dependency of gatelens. Install it beside the project's
environment without touching it, e.g. a virtual environment that sees the project's
packages through a ``.pth`` file::

    python -m venv /tmp/tlv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/tlv/lib/python3.11/site-packages/p.pth
    /tmp/tlv/bin/pip install transformer-lens==4.3.0
    /tmp/tlv/bin/python benchmarks/bench_peer_tl.py [--layers 24] [--windows 2] [--rounds 5]
    /tmp/tlv/bin/python benchmarks/bench_peer_tl.py --memory   # peak memory, one child each

``--memory`` runs each of the four calls in its own process (the model built, and
TransformerLens's bridge in its own call's process only, the peak resident memory reset
through ``/proc/self/clear_refs``, the call made once and its
result held): the peak above the resident set before the call, beside the bytes of the
states it hands over (and of everything it hands over: gatelens's trace holds the keep,
Δ and the output beside the states). The first call of a fresh process: a call after a
warm-up would be measured against a heap that still holds the warm-up's freed blocks.

The model (mamba-130m's shape, random weights) is saved to a temporary directory with a
word-level tokenizer trained on nothing (TransformerLens boots from a directory); nothing is
downloaded. TransformerLens gets its own copy of the model: its bridge wraps the modules
of the model it is handed.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from bench_real_size import build
from timing import interleaved

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def tokenizer(vocab: int, where: str):
    """A word-level tokenizer of ``vocab`` words, saved to and loaded from ``where``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"[UNK]": 0} | {f"w{i}": i for i in range(1, vocab)},
                                    unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[UNK]",
                            bos_token="[UNK]", eos_token="[UNK]").save_pretrained(where)
    return AutoTokenizer.from_pretrained(where)


def setup(layers: int, windows: int, peer: bool = True):
    """The random model, TransformerLens's bridge over a copy of it (``peer``; else None),
    the windows' ids and the calls compared (each returns what it hands over)."""
    import gatelens

    torch.manual_seed(0)
    model, V, words = build("mamba-130m", layers)
    model.eval()
    ids = torch.randint(0, V, (windows, 128), generator=torch.Generator().manual_seed(1))
    bridge, mixers = None, []
    if peer:  # imported only where its own call needs it
        from transformer_lens.model_bridge import TransformerBridge

        with tempfile.TemporaryDirectory() as where:
            model.save_pretrained(where)
            bridge = TransformerBridge.boot_transformers(
                where, hf_model=copy.deepcopy(model), tokenizer=tokenizer(V, where),
                device="cpu")
        mixers = [m for m in bridge.modules() if hasattr(m, "eager_scan")]
    for m in mixers:
        m.eager_scan = True
    wanted = lambda name: name.endswith("hook_ssm_state")  # noqa: E731

    def opened(names=None):
        with gatelens.open_cells(model, names=names) as cache:
            model(ids)
        return cache

    runs = {"transformers' forward": lambda: model(ids),
            "TransformerLens run_with_cache(hook_ssm_state)":
                lambda: bridge.run_with_cache(ids, names_filter=wanted),
            "gatelens open_cells": opened,
            # what TransformerLens hands over: the states alone
            "gatelens open_cells(names=['s'])": lambda: opened(["s"])}
    return model, bridge, ids, words, len(mixers), wanted, opened, runs


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def memory_child(layers: int, windows: int, which: str) -> None:
    """One call's peak resident memory above the resident set before it (MiB), and the MiB
    of per-token states it hands over, as one JSON line."""
    import gc

    # only TransformerLens's process imports it and builds its bridge: no other call's
    # process holds anything of it
    *_, runs = setup(layers, windows, peer=which.startswith("TransformerLens"))
    run = runs[which]
    with torch.no_grad():
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
        before = _kib("VmRSS")
        held = run()
        peak = _kib("VmHWM")
    if isinstance(held, tuple):  # TransformerLens: (logits, cache)
        given = {k: v for k, v in held[1].items()}
    elif hasattr(held, "traces"):  # gatelens: every trace of every call
        given = {n: t[n] for ts in held.traces.values() for t in ts for n in t}
    else:
        given = {}
    spans: dict[int, tuple[int, int]] = {}  # storage -> the bytes its views span
    for v in given.values():
        if isinstance(v, torch.Tensor):
            lo, hi = v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()
            was = spans.get(key := v.untyped_storage().data_ptr(), (lo, hi))
            spans[key] = (min(lo, was[0]), max(hi, was[1]))
    storages = {k: hi - lo for k, (lo, hi) in spans.items()}
    states = [v for k, v in given.items() if k.endswith(("hook_ssm_state", ".s"))]
    print(json.dumps({"call": which, "peak_mib": (peak - before) / 1024,
                      "states_mib": sum(s.numel() * s.element_size() for s in states) / 2**20,
                      "given_mib": sum(storages.values()) / 2**20}))


def memory(args) -> int:
    """Each call in its own process (``memory_child``); a table of their peaks."""
    names = ["transformers' forward", "TransformerLens run_with_cache(hook_ssm_state)",
             "gatelens open_cells", "gatelens open_cells(names=['s'])"]
    print(f"peak resident memory above the set before the call, MiB ({args.layers} layers, "
          f"W = {args.windows}, T = 128, one process a call):")
    for which in names:
        out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers),
                              "--windows", str(args.windows), "--child", which],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {which:48s} peak {row['peak_mib']:7.1f}  states {row['states_mib']:6.1f}  "
              f"all it hands over {row['given_mib']:6.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", action="store_true", help="peak memory, a process a call")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    warnings.filterwarnings("ignore")
    if importlib.util.find_spec("transformer_lens") is None:  # found, not imported
        print("bench_peer_tl: transformer_lens is not installed here (see the module's "
              "docstring)", file=sys.stderr)
        return 2
    import transformers

    transformers.utils.logging.set_verbosity_error()
    if args.child:
        memory_child(args.layers, args.windows, args.child)
        return 0
    if args.memory:
        return memory(args)
    model, bridge, ids, words, mixers, wanted, opened, runs = setup(args.layers, args.windows)
    with torch.no_grad():
        logits, tl_cache = bridge.run_with_cache(ids, names_filter=wanted)
        ours = opened().traces["backbone"][0]
        tl_s = tl_cache["blocks.0.mixer.hook_ssm_state"].permute(0, 2, 1, 3)  # (B, T, D, N)
        own = ours["layer0.s"].view(tl_s.shape)
        scale = own.abs().amax(dim=1, keepdim=True).clamp_min(1)
        print(f"{words}: W = {args.windows}, T = 128, {torch.get_num_threads()} threads; "
              f"{mixers} mixers scanned eagerly by TransformerLens")
        print(f"TransformerLens's layer-0 states against the module's own (gatelens's): "
              f"{float(((tl_s - own).abs() / scale).max()):.1e} scaled; its logits against "
              f"transformers' {float((logits - model(ids).logits).abs().max()):.1e} (abs)")
        del tl_cache, ours
        med = interleaved(runs, args.rounds)
    forward = med["transformers' forward"]
    print(f"median of {args.rounds} interleaved rounds:")
    for name, t in med.items():
        print(f"  {name:48s} {t:.3f} s = {t / forward:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
