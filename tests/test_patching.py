"""Activation patching and attribution patching (issue 28, part 2): the identities of
docs/interventions.md on small stacks, plain and chaotic (every weight x8), the sweep
against a hand loop of ``Lens.run`` with ``gatelens.Patch``, attribution against a central
finite difference, Spearman against a hand-worked example, and every bad input a one-line
GatelensError."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.interventions.metrics import metric_of, metric_value
from gatelens.interventions.patching import state_keys
from gatelens.lens.lens import output_logits

sys.path.insert(0, str(Path(__file__).parent))  # the shared model (importlib mode)
from edit_models import E, H, Net, V  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, P = 2, 12, 8  # P: the one position where clean and corrupt differ


def pair(seed: int = 1) -> tuple[Tensor, Tensor]:
    """Clean ids and the same with position P changed (every other position equal)."""
    clean = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    corrupt = clean.clone()
    corrupt[:, P] = (clean[:, P] + 1 + torch.arange(B)) % V
    return clean, corrupt


def keys(kind: str, layers: int) -> tuple[str, ...]:
    letters = ("c", "h") if kind == "lstm" else ("h",)
    return tuple(f"rnn.layer{k}.{s}" for k in range(layers) for s in letters)


IDENTITY = [("lstm", 1, 1.0), ("lstm", 2, 1.0), ("lstm", 1, 8.0), ("lstm", 2, 8.0),
            ("gru", 1, 1.0), ("gru", 2, 8.0), ("rnn", 1, 1.0), ("rnn", 1, 8.0)]


def within(res, row: int, cols: slice, target: float, dtype: torch.dtype) -> float:
    """max |m(patched) − m(target run)|: float64 exact (1e-10 of the metric), float32 to its
    rounding (1e-6)."""
    m_target = res.m_clean if target == 1 else res.m_corrupt
    got = float(np.abs(res.patched[row, cols] - m_target).max())
    tol = (1e-10 if dtype == torch.float64 else 1e-6) * max(1.0, abs(m_target))
    assert got <= tol, (got, res.effect)
    return got


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind,layers,scale", IDENTITY)
@pytest.mark.parametrize("metric", ["kl", "logit_diff"])
def test_patching_the_whole_state_restores_the_clean_run(kind, layers, scale, metric, dtype):
    # every layer's whole carried state, clean from t >= P on: the rest of the run is the
    # clean run (same inputs after P), effect 1; before P clean == corrupt there, effect 0
    net, (clean, corrupt) = Net(kind, layers, scale).to(dtype), pair()
    m = gatelens.logit_diff(1, 2) if metric == "logit_diff" else metric
    res = gatelens.patch_sweep(gatelens.Lens(net), clean, corrupt, [keys(kind, layers)],
                               metric=m, attribution=False)
    assert res.positions == list(range(T)) and res.names == [" + ".join(keys(kind, layers))]
    within(res, 0, slice(0, P), 0, dtype)
    within(res, 0, slice(P, T), 1, dtype)
    if dtype == torch.float64:
        assert np.abs(res.effect[0, :P]).max() <= 1e-8
        assert np.abs(res.effect[0, P:] - 1).max() <= 1e-8
    assert res.attribution is None and res.spearman is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind,layers,scale", IDENTITY)
def test_the_last_layers_h_at_the_last_position_is_all_the_head_reads(kind, layers, scale,
                                                                       dtype) -> None:
    net, (clean, corrupt) = Net(kind, layers, scale).to(dtype), pair()
    top = f"rnn.layer{layers - 1}.h"
    res = gatelens.patch_sweep(gatelens.Lens(net), clean, corrupt, [top], positions=[-1, 0],
                               metric=gatelens.logit_diff(3, 5), attribution=False)
    assert res.positions == [0, T - 1]
    within(res, 0, slice(1, 2), 1, dtype)
    within(res, 0, slice(0, 1), 0, dtype)


def test_the_sweep_equals_a_hand_loop_of_lens_run_with_patch() -> None:
    net, (clean, corrupt) = Net("lstm", 2), pair(3)
    lens = gatelens.Lens(net)
    names = ["rnn.layer0.c", "rnn.layer1.h", ("rnn.layer0.h", "rnn.layer0.f")]
    res = gatelens.patch_sweep(lens, clean, corrupt, names, positions=[1, 4, P, 11],
                               metric="loss")
    with torch.no_grad():
        def m(ids: Tensor, edits=()) -> float:
            return metric_value(gatelens.loss, lens.run(ids, edits).output, net(clean), clean)

        m_clean, m_corrupt = m(clean), m(corrupt)
        assert res.m_clean == pytest.approx(m_clean, abs=1e-12)
        assert res.m_corrupt == pytest.approx(m_corrupt, abs=1e-12)
        for i, name in enumerate(names):
            group = (name,) if isinstance(name, str) else name
            for j, t in enumerate(res.positions):
                # the sweep's run starts at t from the corrupted run's read-out state (a
                # float32 LSTM's c by its contraction), Lens.run runs the kernel from 0:
                # equal to the float32 rounding of the state (measured 1.2e-9 of a loss of 2)
                got = m(corrupt, [gatelens.Patch(k, source=clean, at=t) for k in group])
                assert res.patched[i, j] == pytest.approx(got, abs=1e-7)
                assert res.effect[i, j] == pytest.approx(
                    (got - m_corrupt) / (m_clean - m_corrupt),
                    abs=1e-7 / abs(m_clean - m_corrupt))
    assert res.names[2] == "rnn.layer0.h + rnn.layer0.f"
    assert res.spearman is not None and -1 <= res.spearman <= 1


def test_default_rows_are_every_state_key() -> None:
    lens = gatelens.Lens(Net("lstm", 2))
    assert state_keys(lens) == [
        "rnn.layer0.c", "rnn.layer0.h", "rnn.layer1.c", "rnn.layer1.h"]
    res = gatelens.patch_sweep(lens, *pair(), positions=[P], attribution=False)
    assert res.names == state_keys(lens)
    assert res.effect.shape == (4, 1) and res.metric == "kl"


@pytest.mark.parametrize("kind,metric", [("lstm", "loss"), ("gru", "kl"), ("rnn", "logit_diff")])
def test_attribution_is_the_gradient_times_the_difference(kind, metric) -> None:
    # float64 model: a central difference along (a_clean - a_corrupt) at one cell checks
    # the backward pass through the edited steps, every key and position of a small sweep
    net = Net(kind, 2, seed=2).double()
    clean, corrupt = pair(4)
    lens = gatelens.Lens(net)
    m = gatelens.logit_diff(0, 6) if metric == "logit_diff" else metric
    names = list(keys(kind, 2))
    res = gatelens.patch_sweep(lens, clean, corrupt, names, positions=[2, P, 10], metric=m)
    span = res.m_clean - res.m_corrupt
    with torch.no_grad():
        ref, bad = lens.run(clean).trace, lens.run(corrupt).trace
        clean_logits = net(clean)
    eps = 1e-5
    for i, k in enumerate(names):
        for j, t in enumerate(res.positions):
            d = ref[k][:, t] - bad[k][:, t]  # (B, H)
            ms = [metric_value(metric_of(m), lens.run(
                corrupt, [gatelens.Add(k, s * eps * d, at=t)]).output, clean_logits, clean)
                for s in (1, -1)]
            fd = (ms[0] - ms[1]) / (2 * eps) / span
            assert res.attribution[i, j] == pytest.approx(fd, abs=1e-6 * max(1, abs(fd)))
    assert np.abs(res.attribution[:, 0]).max() <= 1e-12  # before P: no difference to patch


def test_attribution_leaves_the_models_gradients_alone() -> None:
    net = Net("lstm", 1)
    gatelens.patch_sweep(gatelens.Lens(net), *pair(), positions=[P, 10])
    assert all(p.grad is None for p in net.parameters())
    assert all(p.requires_grad for p in net.parameters()) and net.training  # flags restored


def test_spearman_against_a_hand_worked_example() -> None:
    # ranks x: 1 2 3 4 5; y = (2, 1, 4, 3, 5) -> d = (1, 1, 1, 1, 0), Σd² = 4,
    # ρ = 1 − 6·4 / (5·24) = 0.8
    assert gatelens.spearman([1, 2, 3, 4, 5], [20, 10, 40, 30, 50]) == pytest.approx(0.8)
    # ties take the mean rank: x ranks (1, 2.5, 2.5, 4), y ranks (1, 2, 3, 4):
    # Pearson of the ranks = 4.5 / sqrt(4.5 · 5) = 0.9486832980505138
    assert gatelens.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert gatelens.spearman([3, 2, 1], [1, 2, 3]) == pytest.approx(-1.0)
    assert gatelens.spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side: undefined
    assert gatelens.spearman([1.0, float("nan")], [1, 2]) is None


def test_the_result_as_json() -> None:
    res = gatelens.patch_sweep(gatelens.Lens(Net("gru", 1)), *pair(), positions=[P, 10])
    d = res.to_dict()
    assert d["names"] == ["rnn.layer0.h"] and d["positions"] == [P, 10]
    assert d["batch"] == B and d["length"] == T and d["metric"] == "kl"
    assert d["effect"] == [[pytest.approx(1.0, abs=1e-5)] * 2]
    assert len(d["attribution"][0]) == 2 and isinstance(d["spearman"], (float, type(None)))


def test_texts_with_a_vocabulary() -> None:
    lens = gatelens.Lens(Net("gru", 1), vocab=list("abcdefg"))
    res = gatelens.patch_sweep(lens, "abcdefgab", "abcgefgab", positions=[2, 3, 8],
                               metric="kl", attribution=False)
    assert res.batch == 1 and res.length == 9
    # before the corruption nothing moves: 0 up to float32 rounding (CPUs differ in it)
    assert abs(res.effect[0, 0]) <= 2e-5 and abs(res.effect[0, 1] - 1) <= 2e-5


BAD = [
    (dict(corrupt=torch.zeros(B, T - 1, dtype=torch.long)), "differ in shape"),
    (dict(names=["rnn.layer0.x"]), "no trace key 'rnn.layer0.x'"),
    (dict(names="rnn.layer0.h"), "names must be a non-empty list"),
    (dict(names=["rnn.layer0.h", "rnn.layer0.h"]), "repeat"),
    (dict(positions=[T]), f"position {T} is outside the window of {T}"),
    (dict(positions=[1, 1]), "repeat"),
    (dict(metric="bleu"), "metric must be"),
    (dict(metric=gatelens.logit_diff(0, V)), f"token {V} is outside the model's {V} logits"),
    (dict(metric="logit_diff:1"), "takes two token ids"),
    (dict(units=[H]), f"units [{H}] are outside"),
    (dict(clean="abc"), "needs the Lens's vocab"),
    (dict(corrupt=torch.zeros(B, T)), "corrupt must be ids (B, T) int64"),
    (dict(same=True), "equal, so the normalised effect is undefined"),
]


@pytest.mark.parametrize("kw,words", BAD)
def test_bad_input_is_one_line(kw, words) -> None:
    lens = gatelens.Lens(Net("gru", 1))
    clean, corrupt = pair()
    if kw.pop("same", False):
        corrupt = clean.clone()
    args = {"clean": clean, "corrupt": corrupt, "names": None, "metric": "kl", **kw}
    with pytest.raises(GatelensError) as e:
        gatelens.patch_sweep(lens, **args)
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg


def test_logit_diff_of_one_token_is_refused() -> None:
    with pytest.raises(GatelensError, match="the two tokens are the same"):
        gatelens.logit_diff(2, 2)


class Loop(nn.Module):
    """embedding -> nn.LSTMCell stepped in a Python loop -> head."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed, self.cell, self.head = nn.Embedding(V, E), nn.LSTMCell(E, H), nn.Linear(H, V)
        with torch.no_grad():
            self.cell.weight_hh.mul_(scale)
            self.cell.weight_ih.mul_(scale)

    def forward(self, ids: Tensor) -> Tensor:
        e, ys, state = self.embed(ids), [], None
        for t in range(ids.shape[1]):
            state = self.cell(e[:, t], state)
            ys.append(state[0])
        return self.head(torch.stack(ys, 1))


def charlm(cell: str) -> nn.Module:
    from gatelens.training.model import CharLM

    torch.manual_seed(6)
    return CharLM(vocab_size=V, hidden=H, layers=2, cell=cell, embed=E).eval()


OTHERS = [("cell loop", lambda: Loop(), ["cell.layer0.c", "cell.layer0.h"]),
          ("chaotic cell loop", lambda: Loop(8.0), [("cell.layer0.c", "cell.layer0.h")]),
          ("CharLM mingru", lambda: charlm("mingru"), ["rnn.layer0.h", "rnn.layer1.h"]),
          ("CharLM slstm", lambda: charlm("slstm"), ["rnn.layer1.c", "rnn.layer0.h"])]


@pytest.mark.parametrize("what,make,names", OTHERS, ids=[o[0] for o in OTHERS])
def test_other_families_sweep_and_attribution(what, make, names) -> None:
    # a cell stepped in a loop and gatelens's modern cells: the sweep against Lens.run with
    # Patch, the attribution against a central difference (float64)
    net = make().double()
    lens, (clean, corrupt) = gatelens.Lens(net), pair(8)
    pos = [3, P, T - 1]
    res = gatelens.patch_sweep(lens, clean, corrupt, names, positions=pos, metric="loss")
    ref, bad = lens.run(clean).trace, lens.run(corrupt).trace
    with torch.no_grad():
        clean_logits = output_logits(net(clean))

    def m(edits) -> float:
        out = output_logits(lens.run(corrupt, edits).output)
        return metric_value(gatelens.loss, out, clean_logits, clean)

    span, eps = res.m_clean - res.m_corrupt, 1e-5
    for i, name in enumerate(names):
        group = (name,) if isinstance(name, str) else name
        for j, t in enumerate(pos):
            got = m([gatelens.Patch(k, source=clean, at=t) for k in group])
            assert res.patched[i, j] == pytest.approx(got, abs=1e-9)
            fd = sum(m([gatelens.Add(k, eps * (ref[k][:, t] - bad[k][:, t]), at=t)])
                     - m([gatelens.Add(k, -eps * (ref[k][:, t] - bad[k][:, t]), at=t)])
                     for k in group) / (2 * eps) / span
            assert res.attribution[i, j] == pytest.approx(fd, abs=1e-6 * max(1, abs(fd)))
    assert "forward" not in vars(next(iter(lens.modules.values())))  # put back as it was


def test_a_family_that_cannot_be_edited_is_one_line(monkeypatch) -> None:
    from gatelens.cells.variants import VariantLSTM
    from gatelens.families.base import Family
    from gatelens.families.variants import VariantLSTMFamily

    # every family gatelens opens takes edits: one registered without ``intervene``
    monkeypatch.setattr(VariantLSTMFamily, "intervene", Family.intervene)

    class Peep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.rnn = nn.Embedding(V, E), VariantLSTM(E, H, peepholes=True)
            self.head = nn.Linear(H, V)

        def forward(self, ids: Tensor) -> Tensor:
            return self.head(self.rnn(self.embed(ids))[0])

    with pytest.raises(GatelensError, match=r"interventions do not support the variant_lstm "
                                            r"family \(VariantLSTM\) yet"):
        gatelens.patch_sweep(gatelens.Lens(Peep()), *pair(), positions=[P])
