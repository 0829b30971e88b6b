"""Output-level reach: KL by hand, zero for identical logits, the half-life of a known curve."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis.perturbation import perturb_windows
from gatelens.analysis.reach import kl_per_position, output_reach

F64 = torch.float64


def test_kl_by_hand() -> None:
    """KL(p ‖ q) = Σ p ln(p / q), with logits shifted by constants (softmax ignores them)."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.7, 0.2, 0.1]], dtype=F64)
    q = torch.tensor([[0.25, 0.75, 1.0], [0.1, 0.2, 0.7]], dtype=F64)
    q = q / q.sum(-1, keepdim=True)  # row 0: (0.125, 0.375, 0.5)
    clean = (p.clamp(min=1e-300).log() + 3.0)[None]  # (1, 2, 3); p = 0 stays 0 after softmax
    pert = (q.log() - 7.0)[None]
    kl = kl_per_position(clean, pert)[0]
    want = [0.5 * math.log(0.5 / 0.125) + 0.5 * math.log(0.5 / 0.375),
            0.7 * math.log(7.0) + 0.1 * math.log(1 / 7.0)]
    assert kl.tolist() == pytest.approx(want, rel=1e-12)
    assert kl.dtype == F64


def test_kl_is_averaged_over_windows_at_each_lag() -> None:
    clean = torch.zeros(2, 4, 2)  # uniform everywhere
    pert = clean.clone()
    pert[0, 2] = torch.tensor([0.0, math.log(3.0)])  # window 0, lag 1 from p = 1: (1/4, 3/4)
    r = output_reach(clean, pert, position=1)
    assert r.lags == [1, 2] and r.n == 2
    assert r.kl[0] == pytest.approx(0.5 * 0.5 * math.log(4 / 3), rel=1e-6)  # one window of two
    assert r.kl[1] == 0.0 and r.curve.tolist()[0] == 0.0


def test_identical_logits_give_zero_and_no_half_life() -> None:
    logits = torch.randn(3, 50, 7)
    r = output_reach(logits, logits.clone(), position=10)
    assert r.kl == [0.0] * 6 and float(np.abs(r.curve).max()) == 0.0
    assert r.half_life is None and not r.grows
    assert r.to_dict() == {"lags": [1, 2, 4, 8, 16, 32], "kl": [0.0] * 6, "half_life": None}
    assert "does not reach" in r.describe()


def geometric_logits(amplitude: float, rate: float, T: int, p: int) -> tuple:
    """Two-character logits whose KL at lag k is amplitude · rate^k exactly: for p uniform
    and p' = softmax(0, d), KL = ln cosh(d / 2), so d = 2 acosh(e^KL), written with expm1 and
    log1p so that a KL of 1e-11 keeps its digits."""
    kl = amplitude * rate ** torch.arange(T - p, dtype=F64)  # (T − p,)
    u = torch.expm1(kl)
    d = 2 * torch.log1p(u + torch.sqrt(u * (2 + u)))
    clean = torch.zeros(2, T, 2, dtype=F64)
    pert = clean.clone()
    pert[:, p:, 1] = d
    return clean, pert, kl


@pytest.mark.parametrize("rate", [0.8, 0.5])
def test_half_life_of_a_geometric_curve(rate: float) -> None:
    T, p = 60, 20
    clean, pert, kl = geometric_logits(0.3, rate, T, p)
    r = output_reach(clean, pert, position=p)
    assert r.lags == [1, 2, 4, 8, 16, 32] and r.max_lag == 32
    # Σ p (ln p − ln p') of nearby distributions cancels: ~1e-17 nats of rounding remain
    assert np.allclose(r.curve, kl.numpy(), rtol=1e-9, atol=1e-16)
    # METHODS' formula, to the letter: K · ln 0.5 / ln(KL(K) / KL(1)), KL(K) / KL(1) = rate^(K−1)
    want = 32 * math.log(0.5) / (31 * math.log(rate))
    assert r.half_life == pytest.approx(want, rel=1e-7)
    assert json.loads(json.dumps(r.to_dict()))["half_life"] == pytest.approx(want, rel=1e-7)
    assert r.describe().startswith("the prediction forgets the changed character")


def test_a_growing_curve_has_no_half_life() -> None:
    clean, pert, _ = geometric_logits(1e-3, 1.05, 40, 4)
    r = output_reach(clean, pert, position=4)
    assert r.grows and r.half_life == math.inf
    assert r.to_dict()["half_life"] is None and "grows" in r.describe()


def test_lags_past_the_window_are_dropped_and_inputs_checked() -> None:
    x = torch.randn(2, 10, 3)
    r = output_reach(x, x + 1e-3 * torch.randn(2, 10, 3), position=5, lags=(4, 1, 2, 8))
    assert r.lags == [1, 2, 4] and r.curve.shape == (5,)
    with pytest.raises(ValueError, match="no lag"):
        output_reach(x, x, position=9)
    with pytest.raises(ValueError, match="position"):
        output_reach(x, x, position=10)
    with pytest.raises(ValueError, match="differ in shape"):
        output_reach(x, x[:, :9], position=1)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        output_reach(x[0], x[0], position=1)
    with pytest.raises(ValueError, match="positive ints"):
        output_reach(x, x, position=1, lags=(0, 1))


def test_on_a_small_language_model() -> None:
    """Embedding + LSTM + head: nothing before p moves, the change is seen from p on."""
    torch.manual_seed(0)
    V, B, T, p = 6, 4, 24, 8
    emb, lstm, head = nn.Embedding(V, 5), nn.LSTM(5, 8, batch_first=True), nn.Linear(8, V)
    windows = torch.randint(0, V, (B, T))
    changed = perturb_windows(windows, p, V, seed=0)
    with torch.no_grad():
        clean, pert = (head(lstm(emb(w))[0]) for w in (windows, changed))  # (B, T, V)
    assert torch.equal(clean[:, :p], pert[:, :p])
    r = output_reach(clean, pert, position=p)
    assert r.lags == [1, 2, 4, 8] and r.curve[0] > 0 and all(v > 0 for v in r.kl)
