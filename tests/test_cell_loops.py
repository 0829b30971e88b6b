"""Cells stepped in loops and decoders called per step (issue 17, items 1 and 2): tiny char
models trained here, read out through open_cells / trace / Lens, checked against float64
recomputations written in this file and against the cells' own recorded outputs."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.families.lstm import LSTMFamily
from gatelens.families.registry import family_of
from gatelens.families.rnn import RNNFamily
from gatelens.families.torch_cell import as_module
from gatelens.readout.hooks import open_cells

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from cell_models import CHARS, TEXT, B, CellLM, E, H, T, ids, trained  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def float64_gates(cell: nn.Module, x: Tensor, perm: Tensor | None = None) -> dict[str, Tensor]:
    """The cell's trajectory in float64 (its own forward on a float64 copy) and every gate
    recomputed here from PyTorch's documented equations; ``perm`` reorders the stacked
    rows first (a wrong gate order)."""
    c64 = copy.deepcopy(cell).double()
    x = x.double()  # (B, T, F)
    w = {n: p.detach() for n, p in c64.named_parameters()}
    if perm is not None:
        w = {n: p[perm] for n, p in w.items()}
    b_ih, b_hh = w.get("bias_ih", 0.0), w.get("bias_hh", 0.0)
    state, out = None, {}
    for t in range(x.shape[1]):
        h = torch.zeros(x.shape[0], H, dtype=torch.float64) if state is None else (
            state[0] if isinstance(state, tuple) else state)
        gi = x[:, t] @ w["weight_ih"].t() + b_ih  # (B, G)
        gh = h @ w["weight_hh"].t() + b_hh
        if isinstance(cell, nn.LSTMCell):
            i, f, g, o = (gi + gh).chunk(4, -1)
            sig = {"i": i.sigmoid(), "f": f.sigmoid(), "g": g.tanh(), "o": o.sigmoid()}
        elif isinstance(cell, nn.GRUCell):
            (xr, xz, xn), (hr, hz, hn) = gi.chunk(3, -1), gh.chunk(3, -1)
            r = (xr + hr).sigmoid()
            sig = {"r": r, "z": (xz + hz).sigmoid(), "n": (xn + r * hn).tanh()}
        else:
            sig = {"pre": gi + gh}
        state = c64(x[:, t], state)
        sig["h"] = state[0] if isinstance(state, tuple) else state
        if isinstance(state, tuple):
            sig["c"] = state[1]
        for k, v in sig.items():
            out.setdefault(f"layer0.{k}", []).append(v)
    return {k: torch.stack(v, 1) for k, v in out.items()}  # (B, T, ·)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_relu", "lstm_nobias", "gru_nobias"])
def test_cell_loop_readout_is_float64_and_the_cells_own(kind: str) -> None:
    model = trained(kind)
    with open_cells(model) as cache:
        model(ids())
    x = model.embed(ids()).detach()  # (B, T, E)
    ref64 = float64_gates(model.cell, x)
    assert sorted(k.removeprefix("cell.") for k in cache) == sorted(ref64)
    worst = max((cache["cell." + k].double() - v).abs().max().item() for k, v in ref64.items())
    assert worst < 1e-5, worst
    assert cache.max_abs_diff["cell"] < 1e-5
    fam = family_of(model.cell)
    tr = gatelens.trace(model.cell, x)  # the loop's steps, the cell's own forward
    assert all(torch.equal(tr[k], cache["cell." + k]) for k in tr)
    call = fam.check(x)
    ref = fam.reference(call)
    one = fam.one_step(call, ref)[0]
    assert one.max_abs_diff_h < 1e-5 and (one.max_scaled_diff_c or 0.0) < 1e-5
    # the same comparison would catch a wrong gate order (two blocks swapped)
    n = 4 if "lstm" in kind else 3 if "gru" in kind else 1
    if n > 1:
        rows = torch.arange(n * H).view(n, H)[torch.tensor([1, 0] + list(range(2, n)))]
        wrong = float64_gates(model.cell, x, perm=rows.flatten())
        gate = "layer0.f" if n == 4 else "layer0.z"
        assert (cache["cell." + gate].double() - wrong[gate]).abs().max() > 1e-2


def test_wrong_layout_fails_the_one_step_check() -> None:
    """The one-step reference is the cell's own outputs: a read-out from tensors in the
    wrong gate order (i and f swapped) is caught."""
    cell = trained("lstm").cell
    bad = copy.deepcopy(cell)
    swap = torch.cat([torch.arange(H, 2 * H), torch.arange(H), torch.arange(2 * H, 4 * H)])
    with torch.no_grad():
        for p in bad.parameters():
            p.copy_(p[swap])
    fam = family_of(cell)
    x = torch.randn(3, 10, E)
    call = fam.check(x)
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_abs_diff_h < 1e-5
    fam.inner = LSTMFamily(as_module(bad))
    assert fam.one_step(call, ref)[0].max_abs_diff_h > 1e-3
    # a relu RNNCell read as tanh: the pre-activation agrees, the one-step h does not
    relu = trained("rnn_relu").cell
    tanh = nn.RNNCell(E, H, nonlinearity="tanh")
    tanh.load_state_dict(relu.state_dict())
    fam = family_of(relu)
    call = fam.check(torch.randn(3, 10, E))
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_abs_diff_h < 1e-5
    fam.inner = RNNFamily(as_module(tanh))
    assert fam.one_step(call, ref)[0].max_abs_diff_h > 1e-2


def test_open_cells_names_shapes_and_direct_trace() -> None:
    model = trained("lstm")
    with open_cells(model) as cache:
        model(ids())
    assert list(cache) == [f"cell.layer0.{s}" for s in "ifgoch"]
    assert all(cache[k].shape == (B, T, H) for k in cache)
    assert len(cache.traces["cell"]) == 1 and cache.traces["cell"][0].meta["family"] == \
        "lstm_cell"
    # trace on a sequence with a given state; one step (B, F); float64; bad input
    x, h0, c0 = torch.randn(2, 7, E), torch.randn(2, H), torch.randn(2, H)
    tr = gatelens.trace(model.cell, x, (h0, c0))
    h, c = model.cell(x[:, 0], (h0, c0))
    assert torch.equal(tr["layer0.h"][:, 0], h)  # h is the cell's own
    assert (tr["layer0.c"][:, 0] - c).abs().max() < 1e-6  # c by the contraction
    assert gatelens.trace(model.cell, x[:, 0])["layer0.f"].shape == (2, 1, H)
    assert gatelens.verify(model.cell, x, (h0, c0)).passed
    d = gatelens.verify(copy.deepcopy(model.cell).double(), x.double())
    assert d.passed and d.one_step_max_abs_diff_h < 1e-12
    with pytest.raises(ValueError, match=r"LSTMCell's inputs .* F = 8"):
        gatelens.trace(model.cell, torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match=r"state's c must have shape \(2, 12\)"):
        gatelens.trace(model.cell, x, (h0, torch.zeros(3, H)))


@pytest.mark.parametrize("how", ["none", "zeros"])
def test_a_reset_splits_into_two_trajectories(how: str) -> None:
    base = trained("gru")
    model = copy.deepcopy(base)
    model.reset_at, model.reset = 20, how
    with open_cells(model) as cache:
        model(ids())
    assert [len(t) for t in [cache.traces["cell"]]] == [2]
    assert cache["cell.layer0.z"].shape == (B, 20, H)
    assert cache["cell#1.layer0.z"].shape == (B, T - 20, H)
    x = model.embed(ids()).detach()
    second = gatelens.trace(model.cell, x[:, 20:])  # from zeros, as the reset
    assert torch.equal(second["layer0.z"], cache["cell#1.layer0.z"])
    with pytest.raises(GatelensError, match="form 2 trajectories"):
        gatelens.Lens(model, vocab=CHARS).analyze(ids(), windows=B, length=T, perturb_pos=4)


def test_beam_reorder_splits_and_equal_values_continue() -> None:
    base = trained("lstm")
    cases = {"reorder": (torch.tensor([1, 0, 2, 3, 4, 5]), "same", 2),
             "identity reorder": (torch.arange(B), "same", 1),  # equal values: continues
             "clone": (None, "clone", 1), "in place": (None, "inplace", 2)}
    for name, (order, handback, n) in cases.items():
        model = copy.deepcopy(base)
        model.reset_at = 12 if order is not None else None
        model.reorder, model.handback = order, handback
        with open_cells(model) as cache:
            model(ids())
        assert len(cache.traces["cell"]) == n, name
    with open_cells(base) as ref:
        base(ids())
    model = copy.deepcopy(base)
    model.handback = "clone"
    with open_cells(model) as cache:
        model(ids())
    assert torch.equal(cache["cell.layer0.c"], ref["cell.layer0.c"])


def _figures(rep: dict) -> dict[str, float]:
    out = {f"gates.{g}.{q}": v for g, d in rep["gates"].items() if isinstance(d, dict)
           for q, v in d.items()}
    out.update({f"forget_mean.{k}": v for k, v in rep["units"]["forget_mean"].items()})
    out.update({f"measured.{i}": v for i, v in enumerate(rep["perturbation"]["measured"])})
    out.update({f"forget_only.{i}": v for i, v in enumerate(rep["perturbation"]["forget_only"])})
    out["lyapunov"] = rep["divergence"]["lyapunov_per_char"]
    out.update({f"kl.{i}": v for i, v in enumerate(rep["output_reach"]["kl"])})
    return out


class LSTMLM(nn.Module):
    """The same weights as a CellLM of an LSTMCell, wrapped as an nn.LSTM model."""

    def __init__(self, src: CellLM) -> None:
        super().__init__()
        self.embed, self.head = copy.deepcopy(src.embed), copy.deepcopy(src.head)
        self.lstm = nn.LSTM(E, H, batch_first=True)
        with torch.no_grad():
            for n, p in src.cell.named_parameters():
                getattr(self.lstm, n + "_l0").copy_(p)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def test_lens_on_cell_loops_matches_the_same_weights_as_nn_lstm(tmp_path) -> None:
    model = trained("lstm")
    res = gatelens.Lens(model, vocab=CHARS).analyze(TEXT, windows=B, length=T, perturb_pos=6,
                                                    out=tmp_path / "cell")
    rep = res.reports["cell"]
    assert rep["verification"]["passed"] and rep["model"]["family"] == "lstm_cell"
    assert rep["verification"]["one_step_max_abs_diff_h"] < 1e-5
    assert (tmp_path / "cell" / "cell" / "report.json").is_file()
    lstm = gatelens.Lens(LSTMLM(model), vocab=CHARS).analyze(TEXT, windows=B, length=T,
                                                             perturb_pos=6).reports["lstm"]
    mine, theirs = _figures(rep), _figures(lstm)
    assert set(mine) == set(theirs) and all(math.isfinite(v) for v in mine.values())
    # the loop's cell kernel and nn.LSTM's sequence kernel round differently (float32):
    # 1.3e-7 here; 1e-5 (absolute below 1, relative above) is float32 rounding's bound
    worst = max(abs(mine[k] - theirs[k]) / max(1.0, abs(theirs[k])) for k in mine)
    assert worst < 1e-5, worst
    gru = gatelens.Lens(trained("gru"), vocab=CHARS).analyze(TEXT, windows=B, length=T,
                                                             perturb_pos=6)
    g = gru.reports["cell"]
    assert g["verification"]["passed"] and g["model"]["cell"] == "gru"
    assert all(math.isfinite(v) for v in _figures(g).values() if v is not None)

