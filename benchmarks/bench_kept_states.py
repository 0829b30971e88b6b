"""Mamba-1's states kept from its own loop against replayed: ``gatelens.trace`` of a
mamba-130m-shaped backbone both ways, with the backbone's own forward, in one process.

The three are interleaved round by round (forward, trace keeping the states its scan
formed, trace replaying the scan: ``scan_steps`` switched off for that call), so a change
of load or of the allocator's state falls on all three; each figure is the median of the
rounds. The forward's own time depends on the allocator's state (glibc maps a large
temporary afresh until a larger block has been freed, then serves it from its heap): read
the ratios of one round set, not seconds across runs.

    python benchmarks/bench_kept_states.py [--layers 24] [--windows 2] [--rounds 8]
"""

from __future__ import annotations

import argparse
import warnings

import torch

from bench_real_size import build
from timing import interleaved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    import gatelens
    from gatelens.families.hf_mamba import HFMambaFamily

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model, V, words = build("mamba-130m", args.layers)
    model.eval()
    ids = torch.randint(0, V, (args.windows, args.length),
                        generator=torch.Generator().manual_seed(1))
    lens = gatelens.Lens(model, vocab=V)
    (path,) = list(lens.families)[:1]
    module = lens.families[path].module
    seen = lens.runner(path)(ids)
    kept = HFMambaFamily.scan_steps

    def replayed() -> None:
        HFMambaFamily.scan_steps = lambda self: None  # type: ignore[method-assign]
        try:
            gatelens.trace(module, seen.inputs, seen.state)
        finally:
            HFMambaFamily.scan_steps = kept  # type: ignore[method-assign]

    runs = {"forward": lambda: module(seen.inputs),
            "kept": lambda: gatelens.trace(module, seen.inputs, seen.state),
            "replayed": replayed}
    with torch.no_grad():
        module(seen.inputs)  # warm-up
        med = interleaved(runs, args.rounds)
    print(f"{words}: W = {args.windows}, T = {args.length}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} interleaved rounds")
    print(f"backbone forward {med['forward']:.3f} s; trace, states kept {med['kept']:.3f} s "
          f"= {med['kept'] / med['forward']:.2f}x; replayed {med['replayed']:.3f} s = "
          f"{med['replayed'] / med['forward']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
