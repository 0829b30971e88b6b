"""Cost of opening a cell stepped in a loop: the model's forward inside open_cells (its
calls recorded, stitched at exit, read out and checked) / the same forward alone.

The model is the seed's size as a loop: one-hot input, an nn.LSTMCell (or GRUCell) of 325
units stepped over T = 128 characters in Python, a Linear head, B = 32 windows. Both run
under no_grad in the same process, interleaved (forward, traced, forward, traced, ...) so
machine noise hits both alike; each figure is the median of the repeats after warm-up.
Also timed: the stitched trajectory's verification (the one-step check against the cell's
own outputs, and the free-running re-run), which open_cells does not do.

    .venv/bin/python benchmarks/bench_cell_loop.py --threads 1
    .venv/bin/python benchmarks/bench_cell_loop.py --quick    # smoke run, seconds
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn

from gatelens.families.registry import family_of
from gatelens.readout.hooks import open_cells
from gatelens.readout.stitch import Stitcher
from gatelens.readout.verify import verify_call
from timing import interleaved


class CellLoop(nn.Module):
    """one-hot (B, T, V) -> a cell stepped in Python -> Linear: logits (B, T, V)."""

    def __init__(self, cell: nn.Module, V: int) -> None:
        super().__init__()
        self.cell, self.head = cell, nn.Linear(cell.hidden_size, V)

    def forward(self, x: Tensor) -> Tensor:
        state, hs = None, []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            hs.append(state[0] if isinstance(state, tuple) else state)
        return self.head(torch.stack(hs, 1))  # (B, T, V)


def verify_loop(model: CellLoop, x: Tensor) -> float:
    """The stitched trajectory's verification, as Lens does it: (max one-step error)."""
    fam = family_of(model.cell)
    st = Stitcher(fam)
    hook = model.cell.register_forward_hook(
        lambda m, args, out: st.add(args[0], args[1] if len(args) > 1 else None, out))
    try:
        with torch.no_grad():
            model(x)
    finally:
        hook.remove()
    call = fam.check(st.result()[0])
    return verify_call(fam, call, fam.reference(call)).max_abs_diff_h


def measure(model: CellLoop, x: Tensor, repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds of the forward, the forward in open_cells, and the verification."""
    def forward() -> None:
        with torch.no_grad():
            model(x)

    def traced() -> None:
        with torch.no_grad(), open_cells(model) as cache:
            model(x)
        assert len(cache.traces["cell"]) == 1

    fns = {"forward": forward, "open_cells": traced, "verify": lambda: verify_loop(model, x)}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    return interleaved(fns, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("-B", "--batch", type=int, default=32)
    ap.add_argument("-T", type=int, default=128)
    ap.add_argument("-H", "--hidden", type=int, default=325)
    ap.add_argument("-V", "--vocab", type=int, default=65)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: leave PyTorch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T, H, V, repeats, warmup = args.batch, args.T, args.hidden, args.vocab, args.repeats, 2
    if args.quick:
        T, H, repeats, warmup = 16, 32, 3, 1
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    x = nn.functional.one_hot(ids, V).float()  # (B, T, V)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={B} T={T} H={H} "
          f"V={V}, median of {repeats}")
    print(f"{'cell':<10} {'forward ms':>10} {'open_cells ms':>13} {'ratio':>6} "
          f"{'verify ms':>10} {'ratio':>6} {'one-step':>9}")
    for name, cls in (("LSTMCell", nn.LSTMCell), ("GRUCell", nn.GRUCell)):
        model = CellLoop(cls(V, H), V).eval()
        t = measure(model, x, repeats, warmup)
        err = verify_loop(model, x)
        print(f"{name:<10} {1e3 * t['forward']:>10.1f} {1e3 * t['open_cells']:>13.1f} "
              f"{t['open_cells'] / t['forward']:>6.2f} {1e3 * t['verify']:>10.1f} "
              f"{t['verify'] / t['forward']:>6.2f} {err:>9.2g}")


if __name__ == "__main__":
    main()
