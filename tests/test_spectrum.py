"""The Lyapunov spectrum: λ_1 is the divergence rate, Σ λ_i is mean ln |det J_t| of PyTorch's
own cells, the random tanh network's spectrum matches an independent numpy QR, and a
Jacobian without the LSTM's c path fails the identity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis.divergence import divergence_rate
from gatelens.analysis.slow_modes import SLOW_EXPONENT
from gatelens.analysis.spectrum import (
    SpectrumAccumulator,
    StartFrames,
    divergence_of,
    lyapunov_spectrum,
)
from gatelens.cells.modern import SLSTM, MinGRU
from gatelens.errors import GatelensError
from gatelens.families.base import Dynamics

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def scaled(cls, factor: float, F: int = 5, H: int = 8, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    m = cls(F, H, batch_first=True, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith(("weight_ih", "weight_hh")):
                p.mul_(factor)
    return m.eval()


def onehot(B: int, T: int, F: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return nn.functional.one_hot(torch.randint(0, F, (B, T), generator=g), F).float()


MODELS = {
    "lstm": lambda: scaled(nn.LSTM, 1),
    "lstm x8": lambda: scaled(nn.LSTM, 8, H=16),
    "lstm x16, 2 layers": lambda: scaled(nn.LSTM, 16, H=16, num_layers=2),
    "lstm proj": lambda: scaled(nn.LSTM, 4, proj_size=3),
    "gru x4": lambda: scaled(nn.GRU, 4),
    "rnn x3": lambda: scaled(nn.RNN, 3),
    "gru bidirectional 2 layers": lambda: scaled(nn.GRU, 3, num_layers=2, bidirectional=True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_lambda1_is_the_divergence_rate(name: str, dynamics_of) -> None:
    m, x = MODELS[name](), onehot(3, 40, 5)
    ref = divergence_rate(m, x, seed=4, burn_in=8)
    dyn = dynamics_of(m, x)
    k1 = divergence_of(dyn, seed=4, burn_in=8)
    k64 = lyapunov_spectrum(dyn, seed=4, burn_in=8, hidden=m.hidden_size)
    assert np.abs(k1.per_window - ref.per_window).max() <= 1e-12
    assert np.abs(k64.per_window[:, 0] - ref.per_window).max() <= 1e-12
    assert k1.per_direction.keys() == ref.per_direction.keys()
    for d in ref.per_direction:
        assert abs(k1.per_direction[d] - ref.per_direction[d]) <= 1e-12
        assert abs(k64.per_direction[d].exponents[0] - ref.per_direction[d]) <= 1e-12
    assert k64.k == min(64, dyn[0].size) and k64.per_window.shape == (3, k64.k)
    if "x16" in name:
        assert ref.lyapunov_per_char > 0.1  # the chaotic one is chaotic


@pytest.mark.parametrize("cls", [MinGRU, SLSTM])
def test_lambda1_is_the_divergence_rate_of_gatelens_cells(cls, dynamics_of) -> None:
    torch.manual_seed(1)
    m, x = cls(5, 6, num_layers=2), onehot(2, 30, 5)
    ref = divergence_rate(m, x, seed=2, burn_in=6)
    dyn = dynamics_of(m, x)
    assert np.abs(divergence_of(dyn, 2, 6).per_window - ref.per_window).max() <= 1e-12
    sp = lyapunov_spectrum(dyn, k=10, seed=2, burn_in=6, hidden=6)
    assert np.abs(sp.per_window[:, 0] - ref.per_window).max() <= 1e-12


def cell_of(m: nn.Module, layer: int) -> nn.Module:
    """PyTorch's own one-step cell holding one layer of ``m`` (float64)."""
    cls = {nn.LSTM: nn.LSTMCell, nn.GRU: nn.GRUCell, nn.RNN: nn.RNNCell}[type(m)]
    w = getattr(m, f"weight_ih_l{layer}")
    cell = cls(w.shape[1], m.hidden_size).to(F64).requires_grad_(False)
    with torch.no_grad():
        for n, p in cell.named_parameters():
            p.copy_(getattr(m, f"{n}_l{layer}"))
    return cell


def pytorch_log_det(m: nn.Module, d: Dynamics, burn_in: int) -> np.ndarray:
    """mean over the counted steps of ln |det J_t| per window, J_t the Jacobian of PyTorch's
    own cells (nn.LSTMCell ...) stacked, by torch.func.jacfwd, at the trajectory's states."""
    cells = [cell_of(m, k) for k in range(m.num_layers)]
    lstm = isinstance(m, nn.LSTM)
    H = m.hidden_size

    def stack(x, s):  # s (S,) = h0 | c0 | h1 | c1 … for one window
        parts, out, below = s.split(H), [], x
        for k, cell in enumerate(cells):
            if lstm:
                h, c = cell(below, (parts[2 * k], parts[2 * k + 1]))
                out += [h, c]
            else:
                h = cell(below, parts[k])
                out.append(h)
            below = h
        return torch.cat(out)

    total = np.zeros(d.inputs.shape[0])
    for j, t in enumerate(d.order):
        if j < burn_in:
            continue
        prev = torch.cat(d.previous(j), dim=-1)  # (B, S)
        for b in range(prev.shape[0]):
            J = torch.func.jacfwd(lambda s, b=b, t=t: stack(d.inputs[b, t], s))(prev[b])
            total[b] += float(torch.linalg.slogdet(J).logabsdet)
    return total / (len(d.order) - burn_in)


@pytest.mark.parametrize("name", ["lstm", "lstm 2 layers x6", "gru x4", "rnn x3"])
def test_all_exponents_sum_to_mean_log_det_of_pytorchs_own_cells(name, dynamics_of) -> None:
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[name.split()[0]]
    m = scaled(cls, float(name.split("x")[-1]) if "x" in name else 1.0, H=5,
               num_layers=2 if "2 layers" in name else 1)
    x = onehot(2, 24, 5, seed=1)
    dyn = dynamics_of(m, x)
    sp = lyapunov_spectrum(dyn, k="all", seed=0, burn_in=4, hidden=5)
    ref = pytorch_log_det(m, dyn[0], burn_in=4)
    assert sp.k == dyn[0].size
    assert np.abs(sp.per_window.sum(1) - ref).max() <= 1e-10 * max(1, np.abs(ref).max())
    assert np.abs(sp.log_det_per_window - ref).max() <= 1e-10 * max(1, np.abs(ref).max())
    assert sp.to_dict()["mean_log_abs_det"] == pytest.approx(float(ref.mean()), abs=1e-10)


def h_only_lstm(d: Dynamics, H: int) -> Dynamics:
    """The public Lyapunov code's Jacobian: h by h, c held at the trajectory's value (packed
    into the input), so the c path is dropped."""
    c_prev = torch.cat([d.initial[1][:, None], d.trajectory[1][:, :-1]], dim=1)  # (B, T, H)
    inputs = torch.cat([d.inputs, c_prev], dim=-1)
    F = d.inputs.shape[-1]

    def step(x, s):
        return [d.step(x[:, :F], [s[0], x[:, F:]])[0]]

    return Dynamics(step=step, inputs=inputs, trajectory=[d.trajectory[0]],
                    initial=[d.initial[0]], order=d.order, units=torch.arange(H))


def test_dropping_the_c_path_fails_the_log_det_identity(dynamics_of) -> None:
    m, x = scaled(nn.LSTM, 2, H=5), onehot(2, 24, 5, seed=1)
    d = dynamics_of(m, x)[0]
    ref = pytorch_log_det(m, d, burn_in=4)
    right = lyapunov_spectrum([d], k="all", burn_in=4, hidden=5)
    wrong = lyapunov_spectrum([h_only_lstm(d, 5)], k="all", burn_in=4, hidden=5)
    assert abs(right.sum - ref.mean()) <= 1e-10
    assert abs(wrong.sum - ref.mean()) > 1.0, (wrong.sum, ref.mean())  # fails the identity
    assert abs(wrong.exponents[0] - right.exponents[0]) > 1e-3


def engelken_reference(J: np.ndarray, hs: np.ndarray, burn_in: int, Q0: np.ndarray
                       ) -> np.ndarray:
    """Engelken, Wolf & Abbott's QR method for h ← tanh(J h), in numpy, one window, along
    the states ``hs`` (T, N) (a chaotic trajectory is the module's own: two computations
    of it part like e^{λt})."""
    Q, total = Q0.copy(), np.zeros(Q0.shape[1])
    for t, h in enumerate(hs):
        D = (1 - h**2)[:, None] * J  # ∂h_t/∂h_{t−1} = diag(1 − h_t²) J
        Q, R = np.linalg.qr(D @ Q)
        if t >= burn_in:
            total += np.log(np.abs(np.diag(R)))
    return total / (len(hs) - burn_in)


@pytest.mark.parametrize("g", [0.5, 2.0])
def test_random_tanh_network_matches_engelken_in_numpy(g: float, dynamics_of) -> None:
    N, T, burn = 80, 120, 20
    rng = np.random.default_rng(5)
    J = rng.normal(0, g / math.sqrt(N), (N, N))
    h0 = rng.normal(0, 1, N)
    m = nn.RNN(1, N, batch_first=True, bias=False).to(F64)
    with torch.no_grad():
        m.weight_hh_l0.copy_(torch.from_numpy(J))
        m.weight_ih_l0.zero_()
    dyn = dynamics_of(m, torch.zeros(1, T, 1, dtype=F64),
                                        torch.from_numpy(h0)[None, None])
    sp = lyapunov_spectrum(dyn, k="all", seed=3, burn_in=burn, hidden=N)
    Q0 = StartFrames(3, 1, [N], N).take(0, 1)[0].numpy()
    hs = dyn[0].trajectory[0][0].numpy()  # (T, N)
    assert np.abs(hs[0] - np.tanh(J @ h0)).max() <= 1e-12
    assert np.abs(hs[1:] - np.tanh(hs[:-1] @ J.T)).max() <= 1e-12  # it is h ← tanh(J h)
    ref = engelken_reference(J, hs, burn, Q0)
    assert np.abs(sp.exponents - ref).max() <= 1e-9
    if g < 1:  # h → 0: every exponent is ln |eig(J)| < 0, the largest one below ln g
        assert sp.exponents[0] < 0
    else:  # chaotic for g > 1 at large N (Engelken et al. 2020, their Fig. 1)
        assert sp.exponents[0] > 0.1 and sp.slow_modes[0].half_life == math.inf


def windows(d: Dynamics, a: int, b: int) -> Dynamics:
    """Windows a … b − 1 of a Dynamics."""
    return Dynamics(step=d.step, inputs=d.inputs[a:b], trajectory=[p[a:b] for p in d.trajectory],
                    initial=[p[a:b] for p in d.initial], order=d.order, units=d.units)


def test_chunks_give_the_one_shot_figures(dynamics_of) -> None:
    m, x = scaled(nn.GRU, 4), onehot(5, 30, 5, seed=2)
    dyn = dynamics_of(m, x)
    one = lyapunov_spectrum(dyn, k=6, seed=1, burn_in=5, hidden=8)
    acc = SpectrumAccumulator(k=6, seed=1, burn_in=5, hidden=8, windows=5)
    # chunks of the same trajectory (a float32 module's own run differs with the batch size)
    acc.update([windows(dyn[0], 0, 2)])
    acc.update([windows(dyn[0], 2, 5)])
    two = acc.result()
    assert np.abs(two.per_window - one.per_window).max() <= 1e-12
    assert np.abs(two.loadings - one.loadings).max() <= 1e-12
    with pytest.raises(GatelensError, match="set up for 5 windows"):
        acc.update([windows(dyn[0], 0, 1)])


def rotated_linear(a: list[float], U: torch.Tensor, units: torch.Tensor, B: int = 2,
                   T: int = 80) -> Dynamics:
    """s ← A s with A = U diag(a) Uᵀ: exponents ln a, Lyapunov vectors U's columns."""
    A = U @ torch.diag(torch.tensor(a, dtype=F64)) @ U.T
    z = torch.zeros(B, T, len(a), dtype=F64)
    return Dynamics(step=lambda x, s: [s[0] @ A.T + x], inputs=z, trajectory=[z],
                    initial=[z[:, 0]], order=list(range(T)), units=units)


def test_slow_modes_exponents_participation_and_units() -> None:
    # 4 coordinates = 2 layers × 1 unit × (h, c): units [0, 0, 1, 1] with hidden 1
    r = 1 / math.sqrt(2)
    U = torch.tensor([[r, 0, r, 0], [r, 0, -r, 0], [0, r, 0, r], [0, r, 0, -r]], dtype=F64)
    # λ_2's frame aligns like (0.95 / 0.99)^t: 380 steps of burn-in make it exact
    d = rotated_linear([0.99, 0.95, 0.3, 0.2], U, torch.tensor([0, 0, 1, 1]), T=400)
    sp = lyapunov_spectrum([d], k="all", burn_in=380, hidden=1)
    assert np.abs(sp.exponents - np.log([0.99, 0.95, 0.3, 0.2])).max() <= 1e-12
    modes = sp.slow_modes
    assert [m.index for m in modes] == [0, 1]
    assert modes[0].half_life == pytest.approx(math.log(0.5) / math.log(0.99), rel=1e-10)
    # λ_1's vector is (r, r, 0, 0): one unit (layer 0) with both of its coordinates
    assert modes[0].participation_ratio == pytest.approx(1.0, abs=1e-12)
    assert modes[0].top_units[0] == (0, 0) and modes[1].top_units[0] == (1, 0)
    # spread evenly over 4 units: PR 4
    H = torch.linalg.qr(torch.tensor([[1., 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1],
                                      [1, -1, -1, 1]], dtype=F64)).Q
    even = lyapunov_spectrum([rotated_linear([0.999, 0.2, 0.1, 0.05], H, torch.arange(4))],
                             k=2, burn_in=50, hidden=2)
    assert even.slow_modes[0].participation_ratio == pytest.approx(4.0, abs=1e-10)
    d = sp.to_dict()
    assert list(d) == ["exponents", "burn_in", "sum", "mean_log_abs_det", "slow_modes"]
    assert list(d["slow_modes"][0]) == ["exponent", "half_life", "participation_ratio",
                                        "top_units"]
    assert json.loads(json.dumps(d)) == d and d["slow_modes"][0]["top_units"][0] == [0, 0]
    assert sp.describe().startswith("2 directions of the state hold a change for 10 "
                                    "characters or more (of the 4 computed exponents)")
    assert "about one unit" in sp.describe()
    fast = lyapunov_spectrum([rotated_linear([0.5, 0.4, 0.3, 0.2], U, torch.arange(4))], k=2,
                             burn_in=50, hidden=4)
    assert fast.slow_modes == [] and fast.to_dict()["mean_log_abs_det"] is None
    assert fast.describe().startswith("no direction of the state holds a change for 10")
    assert math.log(0.5) / SLOW_EXPONENT == pytest.approx(10.0)


def test_bad_arguments_are_refused(dynamics_of) -> None:
    dyn = dynamics_of(nn.GRU(3, 4, batch_first=True), torch.randn(1, 10, 3))
    with pytest.raises(GatelensError, match="burn_in 10 leaves no step"):
        lyapunov_spectrum(dyn, burn_in=10, hidden=4)
    with pytest.raises(GatelensError, match="positive int or 'all'"):
        lyapunov_spectrum(dyn, k=0, hidden=4)
    with pytest.raises(GatelensError, match="hidden="):
        lyapunov_spectrum(dyn, burn_in=2)


@pytest.mark.parametrize("cond", [1e2, 1e6, 1e12])
def test_orthonormalise_is_householder_qr_at_any_condition(cond, monkeypatch):
    """CholeskyQR2 where V is well conditioned, Householder where it is not (a Gram matrix
    that squares a condition number of 1e12 is singular in float64): the same |R_ii| and an
    orthonormal Q that spans V's columns either way."""
    from gatelens.analysis.qr import orthonormalise

    gen = torch.Generator().manual_seed(3)
    V = torch.randn(2, 5000, 12, generator=gen, dtype=torch.float64)
    V = V * torch.logspace(0, -math.log10(cond), 12, dtype=torch.float64)
    Qh, Rh = torch.linalg.qr(V)
    if cond <= 1e6:  # the Cholesky passes alone: Householder is not called

        def refused(*a, **k):
            raise AssertionError("Householder's QR on a well-conditioned frame")
        monkeypatch.setattr(torch.linalg, "qr", refused)
    Q, r = orthonormalise(V)
    assert torch.allclose(r, Rh.diagonal(dim1=-2, dim2=-1).abs(), rtol=1e-9, atol=0)
    assert float((Q.mT @ Q - torch.eye(12, dtype=torch.float64)).abs().max()) < 1e-12
    assert torch.allclose((Q * Qh).sum(1).abs(), torch.ones(2, 12, dtype=torch.float64),
                          atol=1e-9, rtol=0)  # the same directions, up to sign


@pytest.mark.parametrize("S", [40, 5000])
def test_the_right_solve_is_the_triangular_solve(S) -> None:
    """Q U⁻¹ by U's inverse and one GEMM (a tall frame) or by the solve (a square one): the
    triangular solve's values to float64 rounding, with U as ill-conditioned as a first
    CholeskyQR pass meets (1e6)."""
    from gatelens.analysis.qr import right_solve

    gen = torch.Generator().manual_seed(4)
    U = torch.linalg.qr(torch.randn(2, 8, 8, generator=gen, dtype=torch.float64))[1]
    U = U * torch.logspace(0, -6, 8, dtype=torch.float64)[:, None]
    Q = torch.randn(2, S, 8, generator=gen, dtype=torch.float64)
    want = torch.linalg.solve_triangular(U, Q, upper=True, left=False)
    got = right_solve(Q, U)
    assert float(((got - want).abs() / want.abs().amax(dim=1, keepdim=True)).max()) < 1e-10
    assert torch.allclose(got @ U, Q, rtol=0, atol=1e-9)


def test_orthonormalise_takes_a_rank_deficient_frame():
    from gatelens.analysis.qr import orthonormalise

    V = torch.randn(1, 300, 4, dtype=torch.float64)
    V[..., 2] = 0.0  # a tangent the step killed: Cholesky fails, Householder goes on
    Q, r = orthonormalise(V)
    assert float(r[0, 2]) == 0.0 and torch.isfinite(Q).all()


def test_tangents_in_smaller_calls_give_the_same_spectrum(dynamics_of, monkeypatch) -> None:
    """A wide state pushes its tangents a few at a time (TANGENT_NUMBERS): the same exponents
    and vectors as all at once, on a chaotic LSTM (×16, 2 layers)."""
    from gatelens.analysis import spectrum

    m, x = MODELS["lstm x16, 2 layers"](), onehot(2, 30, 5)
    dyn = dynamics_of(m, x)
    whole = lyapunov_spectrum(dyn, k=12, seed=1, burn_in=6, hidden=m.hidden_size)
    monkeypatch.setattr(spectrum, "TANGENT_NUMBERS", 2 * dyn[0].size * 3)  # 3 a call
    parts = lyapunov_spectrum(dyn, k=12, seed=1, burn_in=6, hidden=m.hidden_size)
    assert np.abs(parts.per_window - whole.per_window).max() <= 1e-12
    assert np.abs(parts.loadings - whole.loadings).max() <= 1e-12


def test_a_frame_handed_over_is_dropped_once_read(dynamics_of, monkeypatch) -> None:
    """Each frame goes as soon as it is read, so a step holds two frames of (B, S, k), not
    four (24 Mamba-2 layers: 113 MB a frame). CholeskyQR2's second pass runs without V, and
    the frame pushed is gone before its image is orthonormalised (the exponents are the
    same as ever: the chaotic LSTM's figures elsewhere in this file)."""
    import warnings
    import weakref

    from gatelens.analysis import spectrum

    V = torch.randn(1, 400, 3, dtype=torch.float64)
    seen: list[bool] = []
    solve = torch.linalg.solve_triangular

    def watched(*a, **k):
        seen.append(ref() is not None)
        return solve(*a, **k)

    ref = weakref.ref(V)
    held = [V]
    del V
    monkeypatch.setattr(torch.linalg, "solve_triangular", watched)
    Q, r = spectrum.orthonormalise_held(held)
    assert held == [] and seen == [True, False]  # V read by the first pass only
    monkeypatch.setattr(torch.linalg, "solve_triangular", solve)

    m, x = MODELS["lstm x16, 2 layers"](), onehot(2, 30, 5)
    (dyn,) = dynamics_of(m, x)
    frame = torch.linalg.qr(torch.randn(2, dyn.size, 4, dtype=torch.float64))[0]
    start, alive = [frame], weakref.ref(frame)
    del frame
    inner, gone = spectrum.orthonormalise_held, []

    def checked(h):
        gone.append(alive() is None)  # the start frame, pushed, before its image is read
        return inner(h)

    monkeypatch.setattr(spectrum, "orthonormalise_held", checked)
    with warnings.catch_warnings():  # forward AD's decompositions, first loaded (update's)
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated",
                                category=DeprecationWarning)
        exponents = spectrum._direction(dyn, start, 6, int(dyn.units.max()) + 1)[0]
    assert start == [] and len(gone) == 30 and all(gone)
    assert torch.isfinite(exponents).all()
