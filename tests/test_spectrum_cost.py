"""The Lyapunov spectrum's cost rule at size (docs/methods.md "Cost at size"): by default
("auto") a state above 4,096 dimensions gets 16 exponents on 4 windows (64 tangent
trajectories); a count or "all" is taken as asked; below the size nothing changes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import gatelens
from gatelens.analysis.spectrum import SIZE_AT, TANGENT_BUDGET, SpectrumAccumulator, spectrum_plan
from gatelens.families.base import Dynamics

transformers = pytest.importorskip("transformers")


RATES = torch.cat([torch.linspace(0.6, 0.9, 16, dtype=torch.float64),
                   torch.full((SIZE_AT - 12,), 0.05, dtype=torch.float64)])  # 4,100 dims


def _halving(n: int) -> Dynamics:
    """s ← diag(a) s + x on n windows: the exponents are ln a_i (16 well above the rest)."""
    size, T = RATES.shape[0], 40
    x = torch.randn(n, T, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s, traj = torch.zeros(n, size, dtype=torch.float64), []
    for t in range(T):
        s = RATES * s + x[:, t]
        traj.append(s)
    return Dynamics(step=lambda xt, p: [RATES * p[0] + xt], inputs=x,
                    trajectory=[torch.stack(traj, 1)],
                    initial=[torch.zeros(n, size, dtype=torch.float64)],
                    order=list(range(T)), units=torch.arange(size))


def test_the_plan_below_and_above_the_size() -> None:
    assert spectrum_plan("auto", SIZE_AT, 32) == (64, 32, None)  # the seed's default
    k, m, rule = spectrum_plan("auto", SIZE_AT + 1, 32)
    assert (k, m) == (16, 4) and k * m == TANGENT_BUDGET
    assert "4,097 dimensions" in rule and "16 exponents on 4 windows" in rule
    assert spectrum_plan("auto", 10_000, 2) == (32, 2, spectrum_plan("auto", 10_000, 2)[2])
    assert spectrum_plan("all", 10_000, 8) == (10_000, 8, None)
    assert spectrum_plan(3, 10_000, 8) == (3, 8, None)


def test_the_rule_measures_its_windows_however_they_arrive_in_chunks() -> None:
    whole, size = _halving(7), int(RATES.shape[0])
    one = SpectrumAccumulator("auto", seed=3, burn_in=8, hidden=size, windows=7)
    one.update([whole])
    parts = SpectrumAccumulator("auto", seed=3, burn_in=8, hidden=size, windows=7)
    for a, b in ((0, 3), (3, 5), (5, 7)):  # the 4 windows come in two chunks, a third unread
        parts.update([_slice(whole, a, b)])
    r1, r2 = one.result(), parts.result()
    assert (r1.k, r1.windows) == (16, 4) and (r2.k, r2.windows) == (16, 4)
    assert r1.rule == r2.rule and "16 exponents on 4 windows" in r1.rule
    np.testing.assert_allclose(r1.per_window, r2.per_window, rtol=0, atol=1e-12)
    # the 16 exponents span the 16 slow rates' subspace: their sum is Σ ln a_i of those
    # (the bulk's 0.05 is 12x faster, so the frame aligns within the 8 burn-in steps)
    assert abs(r1.sum - float(torch.log(RATES[:16]).sum())) < 1e-6
    asked = SpectrumAccumulator(20, seed=3, burn_in=8, hidden=size, windows=7)
    asked.update([whole])
    r3 = asked.result()
    assert (r3.k, r3.windows, r3.rule) == (20, 7, None)
    np.testing.assert_allclose(r3.per_window[:4, 0], r1.per_window[:, 0], rtol=0, atol=1e-12)


def _slice(d: Dynamics, a: int, b: int) -> Dynamics:
    return replace(d, inputs=d.inputs[a:b], trajectory=[p[a:b] for p in d.trajectory],
                   initial=[p[a:b] for p in d.initial])


def test_an_analysis_at_size_says_the_rule_and_an_asked_count_overrides_it(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=9, hidden_size=32, state_size=64,
                                   num_hidden_layers=1, expand=2, conv_kernel=3,
                                   time_step_rank=4, use_cache=False)
    model = transformers.MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 9, (5, 20), generator=torch.Generator().manual_seed(1))
    lens = gatelens.Lens(model)
    res = lens.analyze(ids, perturb_pos=3, out=tmp_path / "a")
    (path, a), = res.analyses.items()
    assert a.lyapunov.size > SIZE_AT
    rep = json.loads((tmp_path / "a" / path / "report.json").read_text())
    ly = rep["lyapunov"]
    assert (ly["k"], ly["windows"]) == (16, 4) and len(ly["exponents"]) == 16
    assert f"{a.lyapunov.size:,} dimensions" in ly["rule"]
    md = (tmp_path / "a" / path / "report.md").read_text()
    assert "Cost rule: the state has" in md
    assert ly["exponents"][0] >= ly["exponents"][-1]
    asked = lens.measure(path, ids, [str(i) for i in range(9)], perturb_pos=3, exponents=6)
    assert (asked.lyapunov.k, asked.lyapunov.windows, asked.lyapunov.rule) == (6, 5, None)
    assert math.isclose(asked.lyapunov.per_window[:4, 0].mean(), ly["exponents"][0],
                        abs_tol=1e-9)


@pytest.mark.parametrize("size", [58_368, 701_000, 1_200_000, 4_847_616, 40_000_000])
def test_a_frame_of_tangents_stays_within_its_bytes(size):
    """At size the spectrum holds about five frames of k float64 tangent vectors: "auto"
    takes no more exponents than a frame of FRAME_BYTES holds (at least one), says so in its
    rule, and leaves the states below it as the tangent budget alone has them."""
    from gatelens.analysis.spectrum_plan import FRAME_BYTES

    k, m, rule = spectrum_plan("auto", size, 2)
    budget_k = TANGENT_BUDGET // m
    assert k == max(1, min(budget_k, FRAME_BYTES // (8 * size)))
    assert k * size * 8 <= FRAME_BYTES or k == 1
    assert ("MiB" in rule) is (k < budget_k)
    assert spectrum_plan(budget_k + 1, size, 2)[0] == budget_k + 1  # a count is as asked
