"""Per-unit timescales, gate distributions and half_life on hand-built traces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gatelens.analysis import (
    gate_distributions,
    half_life,
    shift_from_init,
    summarize_units,
    unit_timescales,
)
from gatelens.readout.trace_types import Trace


def lstm_trace(f: torch.Tensor, layers: int = 1) -> Trace:
    B, T, H = f.shape
    t = {}
    for k in range(layers):
        t.update({f"layer{k}.{n}": torch.rand(B, T, H, generator=torch.Generator()
                                              .manual_seed(k * 10 + j))
                  for j, n in enumerate("igoch")})
        t[f"layer{k}.f"] = f
    return Trace("lstm", layers, False, t)


@pytest.mark.parametrize("a", [0.1, 0.494, 0.793, 0.99])
def test_constant_forget_gate(a):
    f = torch.full((3, 7, 5), a, dtype=torch.float64)
    u = unit_timescales(lstm_trace(f), init_value=0.5)
    np.testing.assert_allclose(u.forget_means, a, rtol=1e-12)
    assert u.n_units == 5 and u.gate == "f"
    assert u.below_init == (5 if a < 0.5 else 0)
    hl = math.log(0.5) / math.log(a)
    assert u.half_life == pytest.approx({"min": hl, "median": hl, "max": hl})
    assert u.half_life_ge_10 == (5 if hl >= 10 else 0)


def test_half_life_edges_and_arrays():
    assert half_life(1.0) == math.inf and half_life(2.0) == math.inf
    assert half_life(0.0) == 0.0 and half_life(-1.0) == 0.0
    arr = half_life(np.array([0.0, 0.5, 1.0, 0.25]))
    assert arr.tolist() == [0.0, 1.0, math.inf, 0.5]
    assert isinstance(half_life(0.5), float)


def test_summary_matches_numpy_and_infinite_half_life_is_null():
    means = np.array([0.2, 0.3, 0.5, 0.6, 0.95, 1.0])
    u = summarize_units(means, "z", init_value=0.55)
    assert u.forget_mean["p5"] == np.percentile(means, 5)
    assert u.forget_mean["p95"] == np.percentile(means, 95)
    assert u.below_init == 3
    assert u.half_life_ge_10 == 2  # 0.95 → 13.5, 1.0 → inf
    d = u.to_dict()
    assert d["half_life"]["max"] is None and d["half_life"]["min"] == pytest.approx(
        math.log(0.5) / math.log(0.2))


def test_layers_pooled_and_per_unit_means():
    g = torch.Generator().manual_seed(0)
    f = torch.rand(4, 9, 3, generator=g)
    u = unit_timescales(lstm_trace(f, layers=2))
    assert u.n_units == 6
    ref = f.double().mean(dim=(0, 1)).numpy()
    np.testing.assert_allclose(u.forget_means, np.concatenate([ref, ref]), rtol=1e-12)


def test_rnn_has_no_units_and_no_gates():
    tr = Trace("rnn_tanh", 1, False, {"layer0.pre": torch.zeros(1, 2, 3),
                                      "layer0.h": torch.zeros(1, 2, 3)})
    assert unit_timescales(tr) is None
    d = gate_distributions(tr)
    assert d.to_dict() == {"n_values": None}


def test_gate_distributions_match_numpy():
    f = torch.rand(5, 11, 7, generator=torch.Generator().manual_seed(1))
    tr = lstm_trace(f)
    d = gate_distributions(tr).to_dict()
    assert list(d) == ["n_values", "i", "f", "g", "o"]
    assert d["n_values"] == 5 * 11 * 7
    x = f.double().numpy().ravel()
    assert d["f"]["mean"] == pytest.approx(x.mean(), rel=1e-12)
    for q in (5, 25, 50, 75, 95):
        assert d["f"][f"p{q}"] == pytest.approx(np.percentile(x, q), rel=1e-12)


def test_shift_from_init():
    a = summarize_units(np.array([0.4, 0.7, 0.5]), "f", 0.5)
    b = summarize_units(np.array([0.5, 0.5, 0.5]), "f", 0.5)
    s = shift_from_init(a, b)
    assert s["per_unit"] == pytest.approx([-0.1, 0.2, 0.0])
    assert s["mean_abs"] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        shift_from_init(a, summarize_units(np.array([0.5]), "f", 0.5))
