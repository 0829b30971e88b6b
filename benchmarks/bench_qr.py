"""The spectrum's re-orthonormalisation at real state sizes: Householder's QR
(``torch.linalg.qr``) against ``gatelens.analysis.qr.orthonormalise`` (CholeskyQR2,
Householder where a frame is ill-conditioned), one (1, S, k) float64 frame whose columns
span six decades, best of 3 in the same process. Prints one JSON line per size.

    python benchmarks/bench_qr.py           # S = 58,368 … 4,847,616
    python benchmarks/bench_qr.py --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import json

import torch

from gatelens.analysis.qr import orthonormalise
from timing import best_of

#: 2 Mamba layers; 4 (the auto rule's k at that size); one Mamba-2 layer; 24 Mamba layers;
#: 24 Mamba-2 layers
SIZES = ((58_368, 32), (116_736, 64), (201_984, 32), (701_000, 16), (4_847_616, 6))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    for S, k in ((4096, 8),) if args.quick else SIZES:
        V = torch.randn(1, S, k, generator=gen, dtype=torch.float64)
        V = V * torch.logspace(0, -6, k, dtype=torch.float64)
        house = best_of(3, lambda V=V: torch.linalg.qr(V))
        chol = best_of(3, lambda V=V: orthonormalise(V))
        r = torch.linalg.qr(V)[1].diagonal(dim1=-2, dim2=-1).abs()
        gap = float((orthonormalise(V)[1].log() - r.log()).abs().max())
        print(json.dumps({"S": S, "k": k, "householder_s": round(house, 4),
                          "orthonormalise_s": round(chol, 4), "ratio": round(house / chol, 2),
                          "max_log_r_gap": gap}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
