"""Root finding for F(s) = s on batches of starting states (the fixed-point search's solvers).

Every solver works on flat states (N, S), each row independent of the others (a family's
step acts row by row), in float64:

- ``anderson``: Anderson-accelerated fixed-point iteration (type II, Walker & Ni 2011), a
  multisecant quasi-Newton method for g(s) = F(s) − s = 0: one forward a step, so it is the
  cheap first pass; it finds unstable points too, and where a row diverges it goes back to
  its best state and forgets its history (plain iteration from there).
- ``lbfgs``: L-BFGS on q(s) = ½ ‖F(s) − s‖² (one forward and one vector-Jacobian product a
  step, backtracking line search per row), for the rows Anderson leaves unconverged.
- ``newton``: dense Newton steps s ← s − (J − I)⁻¹ (F(s) − s), the polish.
- ``jacobians`` (S forward-mode JVPs) and ``merge`` (points closer than a tolerance).

>>> import torch
>>> F = lambda s: torch.cos(s)  # one root of cos s = s, at 0.739085…
>>> s, q = anderson(F, torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64), 100)
>>> [round(float(v), 9) for v in s[:, 0]], bool((q < 1e-20).all())
([0.739085133, 0.739085133, 0.739085133], True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

TARGET = 1e-20  # q at which a row stops: far below the 1e-12 kept, so duplicates merge
NEWTON_TOL = 1e-10
STALL = 50  # Anderson steps without a new best q before a row is left to L-BFGS


def anderson(F: Callable[[Tensor], Tensor], s: Tensor, max_iter: int, memory: int = 10
             ) -> tuple[Tensor, Tensor]:
    """Anderson-accelerated iteration from the rows of s (N, S); each row's best state and
    its q (N,) (rows still running are computed, the others are not)."""
    g = F(s) - s
    q = 0.5 * (g * g).sum(-1)
    best_s, best_q = s.clone(), q.clone()
    since = torch.zeros_like(q, dtype=torch.long)  # steps since each row's best
    dS: list[Tensor] = []  # Δs and Δg of the last steps, every row (zeros: forgotten)
    dG: list[Tensor] = []
    for _ in range(max_iter):
        idx = ((best_q > TARGET) & (since < STALL)).nonzero()[:, 0]
        if idx.numel() == 0:
            break
        si, gi = s[idx], g[idx]
        step = gi
        if dS:
            A = torch.stack([t[idx] for t in dG], -1)  # (n, S, m)
            M = A.transpose(1, 2) @ A  # (n, m, m)
            eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
            reg = 1e-12 * M.diagonal(dim1=1, dim2=2).sum(-1) + 1e-200  # (n,)
            gamma = torch.linalg.solve(M + reg[:, None, None] * eye,
                                       A.transpose(1, 2) @ gi[..., None])  # (n, m, 1)
            step = gi - ((torch.stack([t[idx] for t in dS], -1) + A) @ gamma)[..., 0]
        new = si + step
        gn = F(new) - new
        qn = 0.5 * (gn * gn).sum(-1)
        bad = ~torch.isfinite(qn) | (qn > 1e4 * best_q[idx] + 1e-8)
        full_s, full_g = torch.zeros_like(s), torch.zeros_like(s)
        full_s[idx], full_g[idx] = new - si, gn - gi
        full_s[idx[bad]], full_g[idx[bad]] = 0.0, 0.0
        dS, dG = (dS + [full_s])[-memory:], (dG + [full_g])[-memory:]
        if bool(bad.any()):  # diverging: back to the best state, history forgotten
            rows = idx[bad]
            for t in dS + dG:
                t[rows] = 0.0
            new[bad], gn[bad], qn[bad] = best_s[rows], F(best_s[rows]) - best_s[rows], \
                best_q[rows]
        s[idx], g[idx] = new, gn
        better = qn < best_q[idx]
        best_s[idx[better]], best_q[idx[better]] = new[better], qn[better]
        since[idx] = torch.where(better, 0, since[idx] + 1)
    return best_s, best_q


def q_and_grad(F: Callable[[Tensor], Tensor], s: Tensor) -> tuple[Tensor, Tensor]:
    """q (N,) and its gradient (J − I)ᵀ r (N, S), the starts independent of each other."""
    with torch.enable_grad():
        r, vjp = torch.func.vjp(lambda v: F(v) - v, s)
        return 0.5 * (r * r).sum(-1).detach(), vjp(r.detach())[0].detach()


def _direction(g: Tensor, hist: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
    """−H g by the two-loop recursion, each row its own history (ρ = 0: a skipped pair)."""
    d, alphas = -g, []
    for ds, dg, rho in reversed(hist):
        a = rho * (ds * d).sum(-1)
        d = d - a[:, None] * dg
        alphas.append(a)
    if hist:
        ds, dg, rho = hist[-1]
        gamma = torch.where(rho > 0, 1 / (rho * (dg * dg).sum(-1)).clamp(min=1e-300),
                            torch.ones_like(rho))  # sᵀy / yᵀy
        d = d * gamma[:, None]
    for (ds, dg, rho), a in zip(hist, reversed(alphas), strict=True):
        d = d + (a - rho * (dg * d).sum(-1))[:, None] * ds
    return torch.where(((g * d).sum(-1) < 0)[:, None], d, -g)  # else steepest descent


def lbfgs(F: Callable[[Tensor], Tensor], s: Tensor, max_iter: int, memory: int = 10
           ) -> tuple[Tensor, Tensor]:
    """Batched L-BFGS on q from the starts s (N, S), each start its own history and
    backtracking (Armijo) line search, computed on the starts still running only;
    returns the final states and q (N,)."""
    q, g = q_and_grad(F, s)
    hist: list[tuple[Tensor, Tensor, Tensor]] = []  # (Δs, Δg, ρ) of every start
    done = q <= TARGET  # converged far below the threshold, or stuck
    for _ in range(max_iter):
        idx = (~done).nonzero()[:, 0]
        if idx.numel() == 0:
            break
        si, qi, gi = s[idx], q[idx], g[idx]
        d = _direction(gi, [(a[idx], b[idx], c[idx]) for a, b, c in hist])
        slope = (gi * d).sum(-1)
        new, nq, ng = si + d, *q_and_grad(F, si + d)  # the full step, usually taken
        todo = ~(nq <= qi + 1e-4 * slope)
        if bool(todo.any()):  # backtracking (Armijo), per start, on those that need it
            alpha = torch.full_like(qi, 0.5)
            for _ in range(40):
                trial = si + alpha[:, None] * d
                r = F(trial) - trial
                ok = todo & (0.5 * (r * r).sum(-1) <= qi + 1e-4 * alpha * slope)
                new[ok] = trial[ok]
                todo &= ~ok
                if not bool(todo.any()):
                    break
                alpha = torch.where(todo, alpha * 0.5, alpha)
            redo = (~todo & ~(nq <= qi + 1e-4 * slope)).nonzero()[:, 0]
            if redo.numel():
                nq[redo], ng[redo] = q_and_grad(F, new[redo])
        moved = ~todo
        ds, dg = new - si, ng - gi
        sy = (ds * dg).sum(-1)
        rho = torch.where(moved & (sy > 1e-300), 1 / sy.clamp(min=1e-300), torch.zeros_like(sy))
        full = [torch.zeros_like(s), torch.zeros_like(s), torch.zeros_like(q)]
        for t, v in zip(full, (ds, dg, rho), strict=True):
            t[idx] = v
        hist = (hist + [tuple(full)])[-memory:]
        s[idx[moved]], q[idx[moved]], g[idx[moved]] = new[moved], nq[moved], ng[moved]
        done[idx[~moved]] = True  # no decrease along a descent direction: as low as it goes
        done |= q <= TARGET
    return s, q


def jacobians(F: Callable[[Tensor], Tensor], s: Tensor) -> Tensor:
    """∂F/∂s at each of the states s (P, S): (P, S, S), by S forward-mode JVPs."""
    S = s.shape[1]
    eye = torch.eye(S, dtype=s.dtype, device=s.device)
    cols = torch.func.vmap(lambda v: torch.func.jvp(F, (s,), (v.expand_as(s),))[1],
                           chunk_size=128)(eye)  # (S, P, S): column j of every J
    return cols.permute(1, 2, 0)


def merge(states: Tensor, q: Tensor, tol: float) -> list[int]:
    """Indices of the points kept when those closer than ``tol`` are merged (lowest q)."""
    kept: list[int] = []
    for i in torch.argsort(q).tolist():
        if all(float((states[i] - states[j]).norm()) >= tol for j in kept):
            kept.append(i)
    return kept


def newton(F: Callable[[Tensor], Tensor], s: Tensor, steps: int = 20) -> Tensor:
    """Newton steps s ← s − (J − I)⁻¹ (F(s) − s) on each point (P, S) until a step's largest
    coordinate is below NEWTON_TOL (or ``steps`` are taken, or J − I is singular)."""
    eye = torch.eye(s.shape[1], dtype=s.dtype, device=s.device)
    todo = torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
    for _ in range(steps):
        if not bool(todo.any()):
            break
        idx = todo.nonzero()[:, 0]
        sub = s[idx]
        with torch.no_grad():
            r = F(sub) - sub  # (P', S)
        delta, info = torch.linalg.solve_ex(jacobians(F, sub) - eye, -r)
        good = (info == 0) & torch.isfinite(delta).all(-1)
        s[idx[good]] = sub[good] + delta[good]
        small = delta.abs().amax(-1) <= NEWTON_TOL
        todo[idx[~good | small]] = False
    return s


