"""The divergence rate: exact on known Jacobians, equal to PyTorch's own finite differences."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis.divergence import DivergenceRate, divergence_rate

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def permutation(n: int, seed: int) -> torch.Tensor:
    """An n × n permutation matrix: orthogonal, and it keeps a positive vector positive."""
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return torch.eye(n, dtype=F64)[idx]


def linear_relu(a: list[float], n: int = 5, layers: int = 1, bidirectional: bool = False,
                F: int = 3) -> nn.RNN:
    """A relu RNN whose every pre-activation is ≥ 1 on non-negative input, so each step's
    Jacobian is exactly a·P (block-diagonal over layers, as layer k > 0 reads nothing)."""
    m = nn.RNN(F, n, num_layers=layers, nonlinearity="relu", batch_first=True,
               bidirectional=bidirectional).to(F64)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(m.named_parameters())):
            if name.startswith("weight_hh"):
                p.copy_(a[i % len(a)] * permutation(n, seed=i))
            elif name.startswith("weight_ih"):
                p.copy_(p.abs() if name.endswith("_l0") or "_l0_" in name else 0 * p)
            elif name.startswith("bias_ih"):
                p.fill_(1.0)
            else:
                p.zero_()
    return m.eval()


@pytest.mark.parametrize("a", [0.5, 1.5])
def test_exact_on_a_scaled_permutation(a: float) -> None:
    x = torch.rand(4, 40, 3, dtype=F64)  # non-negative: every pre-activation stays ≥ 1
    d = divergence_rate(linear_relu([a]), x, seed=3, burn_in=10)
    assert abs(d.lyapunov_per_char - math.log(a)) <= 1e-9
    assert np.abs(d.per_window - math.log(a)).max() <= 1e-9 and d.sd_over_windows <= 1e-12
    assert d.regime == ("contracting" if a < 1 else "chaotic")
    if a < 1:
        assert d.halving_chars == pytest.approx(1.0) and d.doubling_chars == math.inf
    else:
        assert d.halving_chars == math.inf
        assert d.doubling_chars == pytest.approx(math.log(2) / math.log(1.5))


def test_exact_over_a_two_layer_state() -> None:
    """The tangent spans both layers; with the same factor in each, growth is exactly a."""
    m = linear_relu([0.7], layers=2)
    assert m.weight_ih_l1.abs().max() == 0 and m.weight_hh_l1.abs().max() > 0
    d = divergence_rate(m, torch.rand(3, 30, 3, dtype=F64), burn_in=0)
    assert abs(d.lyapunov_per_char - math.log(0.7)) <= 1e-9


def test_bidirectional_reports_the_larger_direction() -> None:
    m = linear_relu([0.5, 1.5], bidirectional=True)  # sorted names: l0 (0.5), l0_reverse (1.5)
    assert torch.allclose(m.weight_hh_l0_reverse.abs().sum(0), torch.full((5,), 1.5, dtype=F64))
    d = divergence_rate(m, torch.rand(2, 30, 3, dtype=F64), burn_in=4)
    assert d.per_direction["forward"] == pytest.approx(math.log(0.5), abs=1e-9)
    assert d.per_direction["reverse"] == pytest.approx(math.log(1.5), abs=1e-9)
    assert d.lyapunov_per_char == pytest.approx(math.log(1.5), abs=1e-9)


@pytest.mark.parametrize("proj", [0, 3])
def test_equals_central_differences_through_pytorchs_own_step(proj: int) -> None:
    """Independent of equations.py: PyTorch's LSTM stepped from s ± εv, same start vectors,
    from a given initial state; with a projection h has P units, c has H."""
    torch.manual_seed(3)
    m = nn.LSTM(4, 6, num_layers=2, batch_first=True, proj_size=proj).to(F64).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("weight"):
                p.mul_(4)
    B, T, burn, eps, P = 3, 30, 5, 1e-6, proj or 6
    x = torch.randn(B, T, 4, dtype=F64)
    h, c = torch.randn(2, B, P, dtype=F64), torch.randn(2, B, 6, dtype=F64)
    d = divergence_rate(m, x, seed=7, burn_in=burn, state=(h, c))
    v = torch.randn(B, 2 * (P + 6), generator=torch.Generator().manual_seed(7), dtype=F64)
    v = v / v.norm(dim=-1, keepdim=True)  # layout h0 | c0 | h1 | c1
    total = torch.zeros(B, dtype=F64)
    for t in range(T):
        parts = v.split([P, 6, P, 6], dim=-1)
        vh, vc = torch.stack(parts[0::2]), torch.stack(parts[1::2])  # (2, B, P), (2, B, 6)
        xt = x[:, t : t + 1]
        with torch.no_grad():
            _, (hp, cp) = m(xt, (h + eps * vh, c + eps * vc))
            _, (hm, cm) = m(xt, (h - eps * vh, c - eps * vc))
            _, (h, c) = m(xt, (h, c))
        dh, dc = (hp - hm) / (2 * eps), (cp - cm) / (2 * eps)
        jv = torch.cat([dh[0], dc[0], dh[1], dc[1]], dim=-1)  # (B, S)
        g = jv.norm(dim=-1)
        if t >= burn:
            total += torch.log(g)
        v = jv / g[:, None]
    ref = (total / (T - burn)).numpy()
    assert np.abs(d.per_window - ref).max() <= 1e-7, (d.per_window, ref)


def scaled_lstm(factor: float, seed: int = 0) -> nn.LSTM:
    torch.manual_seed(seed)
    m = nn.LSTM(64, 128, num_layers=2, batch_first=True)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith(("weight_ih", "weight_hh")):
                p.mul_(factor)
    return m.eval()


def test_plain_lstm_contracts_and_the_x16_lstm_is_chaotic() -> None:
    g = torch.Generator().manual_seed(0)
    x = nn.functional.one_hot(torch.randint(0, 64, (8, 64), generator=g), 64).float()
    plain, wild = divergence_rate(scaled_lstm(1), x), divergence_rate(scaled_lstm(16), x)
    assert plain.lyapunov_per_char < -0.1 and plain.regime == "contracting"
    assert wild.lyapunov_per_char > 0.1 and wild.regime == "chaotic"
    assert plain.describe().startswith("contracting: a difference halves every ")
    assert wild.describe().startswith("chaotic: nearby texts part like e^{")
    d = wild.to_dict()
    assert list(d) == ["lyapunov_per_char", "sd_over_windows", "burn_in", "regime"]
    assert json.loads(json.dumps(d)) == d and d["burn_in"] == 16
    assert 0 < d["sd_over_windows"] < abs(d["lyapunov_per_char"])


def test_seeded_and_deterministic() -> None:
    m = scaled_lstm(4, seed=1)
    x = torch.randn(4, 32, 64, generator=torch.Generator().manual_seed(1))
    a, b = divergence_rate(m, x, seed=5), divergence_rate(m, x, seed=5)
    other = divergence_rate(m, x, seed=6)
    assert np.array_equal(a.per_window, b.per_window)
    assert not np.array_equal(a.per_window, other.per_window)
    # float32 module: the same λ as its float64 copy to rounding (the jvp is float64 anyway)
    m64 = scaled_lstm(4, seed=1).double()
    assert abs(divergence_rate(m64, x.double(), seed=5).lyapunov_per_char
               - a.lyapunov_per_char) <= 1e-4


def test_one_window_has_zero_spread_and_bad_burn_in_is_refused() -> None:
    m = nn.GRU(3, 4, batch_first=True)
    d = divergence_rate(m, torch.randn(1, 10, 3), burn_in=2)
    assert d.sd_over_windows == 0.0 and d.per_window.shape == (1,)
    for bad in (10, -1, 2.5):
        with pytest.raises(ValueError, match="burn_in"):
            divergence_rate(m, torch.randn(1, 10, 3), burn_in=bad)  # type: ignore[arg-type]


def test_describe_and_json_of_the_edges() -> None:
    zero = DivergenceRate(0.0, 0.0, 16, np.zeros(1))
    assert zero.regime == "chaotic" and zero.halving_chars == math.inf
    assert zero.to_dict()["lyapunov_per_char"] == 0.0
    dead = DivergenceRate(-math.inf, math.nan, 16, np.full(2, -math.inf))
    assert dead.to_dict()["lyapunov_per_char"] is None and dead.regime == "contracting"
