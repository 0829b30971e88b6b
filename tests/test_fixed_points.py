"""Fixed points: the analytic 3-unit RNN, a trained 3-bit flip-flop (Sussillo & Barak 2013),
and LSTM/GRU points checked against PyTorch's own cells and the module iterated."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis.fixed_points import (
    FixedPoint,
    dynamics_fixed_points,
    fixed_points,
    held_inputs,
)
from gatelens.cells.equations import cell_weights, step
from gatelens.errors import GatelensError

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def test_three_unit_rnn_has_27_points_and_8_stable_corners() -> None:
    m = nn.RNN(1, 3, batch_first=True).to(F64)
    with torch.no_grad():
        m.weight_hh_l0.copy_(2 * torch.eye(3))
        for p in (m.weight_ih_l0, m.bias_ih_l0, m.bias_hh_l0):
            p.zero_()
    w = cell_weights(m, dtype=F64)
    starts = torch.rand(512, 3, generator=torch.Generator().manual_seed(0), dtype=F64) * 2.4 - 1.2
    fp = fixed_points(lambda x, s: [step(w, x, s[0])["h"]], starts,
                      {"zero": torch.zeros(1, dtype=F64)})
    pts = fp.inputs[0].points
    a = 0.957504024  # tanh(2a) = a, by bisection below
    lo, hi = 0.5, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.tanh(2 * mid) > mid else (lo, mid)
    assert abs(lo - a) <= 1e-9
    assert len(pts) == 27
    coords = np.array([p.state for p in pts])  # (27, 3)
    assert np.abs(np.abs(coords) - np.where(np.abs(coords) > 0.5, lo, 0)).max() <= 1e-12
    assert len({tuple(np.sign(np.round(c, 6))) for c in coords}) == 27
    stable = [p for p in pts if p.stable]
    assert len(stable) == 8 and all(np.all(np.abs(p.state) > 0.9) for p in stable)
    mu = 2 * (1 - lo**2)  # the corners' eigenvalue, thrice
    for p in stable:
        assert abs(p.max_abs_eig - mu) <= 1e-10
        assert p.slowest_half_life == pytest.approx(math.log(0.5) / math.log(mu), rel=1e-9)
    for p in pts:
        if not p.stable:
            assert p.max_abs_eig == pytest.approx(2.0, abs=1e-12) and p.slowest_half_life is None
        assert p.q < 1e-12
    d = fp.to_dict()
    assert list(d) == ["inputs"] and list(d["inputs"][0]) == ["input", "points"]
    assert list(d["inputs"][0]["points"][0]) == ["q", "stable", "max_abs_eig", "slowest_half_life"]
    assert json.loads(json.dumps(d)) == d and d["inputs"][0]["input"] == "zero"
    assert len(fp.to_dict(state=True)["inputs"][0]["points"][0]["state"]) == 3
    assert fp.describe().startswith("under the zero input: 27 fixed points, 8 stable")


def flipflop(B: int, T: int, g: torch.Generator, p: float = 0.1):
    """3 channels of ±1 pulses (every channel pulses at t = 0); the target holds each
    channel's last pulse."""
    sign = 2 * (torch.rand(B, T, 3, generator=g) < 0.5).float() - 1
    pulse = (torch.rand(B, T, 3, generator=g) < p).float() * sign
    pulse[:, 0] = sign[:, 0]
    out, last = torch.zeros(B, T, 3), torch.zeros(B, 3)
    for t in range(T):
        last = torch.where(pulse[:, t] != 0, pulse[:, t], last)
        out[:, t] = last
    return pulse, out


def test_trained_flip_flop_rnn_has_its_8_stable_points(dynamics_of) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rnn, head = nn.RNN(3, 32, batch_first=True), nn.Linear(32, 3)
    with torch.no_grad():
        nn.init.orthogonal_(rnn.weight_hh_l0)
    params = [*rnn.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(300):
        x, y = flipflop(128, 32, g)
        loss = ((head(rnn(x)[0]) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    x, y = flipflop(16, 128, g, p=0.05)
    rnn, head = rnn.double().eval(), head.double().requires_grad_(False)
    with torch.no_grad():
        assert float(((head(rnn(x.double())[0]) - y) ** 2).mean()) < 0.01  # it learnt the task
    d = dynamics_of(rnn, x.double())[0]
    fp = dynamics_fixed_points(d, {"zero": torch.zeros(3, dtype=F64)}, starts=256, seed=0)
    stable = [p for p in fp.inputs[0].points if p.stable]
    assert len(stable) == 8
    # one per memory: the read-out's signs are the 8 corners of the cube
    signs = {tuple(torch.sign(head(torch.from_numpy(p.state))).tolist()) for p in stable}
    assert len(signs) == 8
    for p in stable:  # PyTorch's own RNN, started at the point, stays there
        h = torch.from_numpy(p.state)[None, None]
        with torch.no_grad():
            _, hn = rnn(torch.zeros(1, 200, 3, dtype=F64), h)
        assert float((hn[0, 0] - h[0, 0]).abs().max()) <= 1e-9


def pytorch_cell(m: nn.Module) -> nn.Module:
    cls = {nn.LSTM: nn.LSTMCell, nn.GRU: nn.GRUCell}[type(m)]
    cell = cls(m.input_size, m.hidden_size).to(F64).requires_grad_(False)
    with torch.no_grad():
        for n, p in cell.named_parameters():
            p.copy_(getattr(m, f"{n}_l0"))
    return cell


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_lstm_and_gru_points_are_pytorchs_own(cls, dynamics_of) -> None:
    torch.manual_seed(2)
    m = cls(4, 6, batch_first=True).to(F64).eval()
    with torch.no_grad():
        m.weight_hh_l0.mul_(2.5)
    ids = torch.randint(0, 4, (3, 30), generator=torch.Generator().manual_seed(1))
    ids[0, :10] = 2  # the most frequent character
    x = nn.functional.one_hot(ids, 4).to(F64)
    d = dynamics_of(m, x)[0]
    held = held_inputs(d, ids, list("abcd"), n=2)
    assert list(held)[0] == "c" and list(held)[-1] == "zero" and len(held) == 3
    assert torch.equal(held["c"], nn.functional.one_hot(torch.tensor(2), 4).to(F64))
    fp = dynamics_fixed_points(d, held, starts=32, seed=3)
    cell, lstm = pytorch_cell(m), cls is nn.LSTM
    H = 6

    def own(xs, s):  # PyTorch's own one step on the flat state (h | c)
        if lstm:
            return torch.cat(cell(xs, (s[:H], s[H:])))
        return cell(xs, s)

    for h_in in fp.inputs:
        xs = held[h_in.input]
        assert h_in.points and h_in.converged > 0
        # the module itself run 400 steps on the held input from a trajectory state
        st = tuple(p[1, 7][None, None].contiguous() for p in d.trajectory)  # (1, 1, ·)
        with torch.no_grad():
            _, fin = m(xs.expand(1, 400, 4), st if lstm else st[0])
        end = torch.cat([fin[0][0, 0], fin[1][0, 0]]) if lstm else fin[0, 0]
        for p in h_in.points:
            s = torch.from_numpy(p.state)
            assert float((own(xs, s) - s).abs().max()) <= 1e-9
            J = torch.func.jacfwd(lambda v, xs=xs: own(xs, v))(s)
            mu = torch.linalg.eigvals(J).abs().max()
            assert abs(float(mu) - p.max_abs_eig) <= 1e-10
        stable = [p for p in h_in.points if p.stable]
        assert min(np.abs(p.state - end.numpy()).max() for p in stable) <= 1e-8


def test_slowest_half_life_and_bad_input() -> None:
    p = FixedPoint(np.zeros(2), 0.0, np.array([0.5 + 0.5j, 0.1]))
    assert p.stable and p.slowest_half_life == pytest.approx(math.log(0.5) / math.log(0.5**0.5))
    assert FixedPoint(np.zeros(1), 0.0, np.array([0.0])).slowest_half_life == 0.0
    u = FixedPoint(np.zeros(1), 0.0, np.array([-1.0]))
    assert not u.stable and u.to_dict() == {"q": 0.0, "stable": False, "max_abs_eig": 1.0,
                                            "slowest_half_life": None}
    with pytest.raises(GatelensError, match=r"\(N, S\)"):
        fixed_points(lambda x, s: s, torch.zeros(3), {"zero": torch.zeros(1)})
    with pytest.raises(GatelensError, match="add up"):
        fixed_points(lambda x, s: s, torch.zeros(3, 4), {"zero": torch.zeros(1)}, sizes=[3])
