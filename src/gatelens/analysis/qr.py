"""Orthonormalising the spectrum's frames (analysis/spectrum.py): Q with orthonormal columns
and |R_ii| of V = Q R, by CholeskyQR2 where V's condition allows, else Householder's QR.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["orthonormalise", "orthonormalise_held", "right_solve"]


def orthonormalise(V: Tensor) -> tuple[Tensor, Tensor]:
    """Q (B, S, k) with orthonormal columns and |R_ii| (B, k) of V = Q R.

    CholeskyQR2: twice, R from the Cholesky factor of VᵀV and Q = V R⁻¹, two GEMMs a pass
    (2–3× faster than Householder at S = 58k–701k, the same |R_ii| to 1e-15); exact to
    float64 rounding while V's condition number is below ~1e7, which the second pass's Gram
    matrix shows (within 0.1 of I); else Householder's QR.

    >>> Q, r = orthonormalise(torch.tensor([[[3.0, 1], [4, 2], [0, 2]]], dtype=torch.float64))
    >>> [round(float(x), 9) for x in r[0]], float((Q.mT @ Q - torch.eye(2)).abs().max()) < 1e-15
    ([5.0, 2.039607805], True)
    """
    return orthonormalise_held([V])


def orthonormalise_held(held: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``orthonormalise`` of the frame ``held`` hands over (the list is emptied): V is
    dropped once the second pass's checks say Householder will not need it, so a pass holds
    two frames, not three (24 Mamba-2 layers: 113 MB a frame)."""
    V = held.pop()
    eye = torch.eye(V.shape[-1], dtype=V.dtype, device=V.device)
    Q, R = V, eye
    for attempt in range(2):
        G = Q.mT @ Q  # (B, k, k)
        if attempt == 1 and float((G - eye).abs().max()) > 0.1:
            break
        L, info = torch.linalg.cholesky_ex(G)
        if bool(info.any()):
            break
        if attempt == 1:
            V = None  # the checks passed: Householder's fallback will not read it
        Q = right_solve(Q, L.mT)
        R = L.mT @ R
    else:
        return Q, R.diagonal(dim1=-2, dim2=-1).abs()
    Q, R = torch.linalg.qr(V)
    return Q, R.diagonal(dim1=-2, dim2=-1).abs()


def right_solve(Q: Tensor, U: Tensor) -> Tensor:
    """Q U⁻¹ for an upper triangular U (B, k, k): a tall Q (S ≥ 16 k) times U's inverse
    from the k × k system, one GEMM (faster than the solve with S right-hand sides, the
    same to float64 rounding: bench_qr.py, BENCHMARKS.md); a square Q is solved.

    >>> U = torch.tensor([[[2.0, 1.0], [0.0, 4.0]]], dtype=torch.float64)
    >>> Q = torch.arange(64.0, dtype=torch.float64).view(1, 32, 2)
    >>> torch.allclose(right_solve(Q, U) @ U, Q, rtol=0, atol=1e-13)
    True
    """
    k = U.shape[-1]
    if Q.shape[-2] < 16 * k:
        return torch.linalg.solve_triangular(U, Q, upper=True, left=False)
    eye = torch.eye(k, dtype=U.dtype, device=U.device).expand_as(U)
    return Q @ torch.linalg.solve_triangular(U, eye, upper=True)
