"""Causal memory (issue 28, part 4; docs/methods.md "Interventions"): the return path cut
reproduces each layer's forget-only curve (nn.LSTM, nn.GRU, gatelens's minGRU; plain and
chaotic, every weight x8 and x16), and the state ablation's KL at lag 0 and lag 1 against
the model's head and the module's OWN forward from the ablated state, computed here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.analysis.perturbation import perturb_windows
from gatelens.errors import GatelensError
from gatelens.interventions.causal import return_cut, state_ablation
from gatelens.training.model import CharLM

sys.path.insert(0, str(Path(__file__).parent))  # the shared model (importlib mode)
from edit_models import KINDS, E, H, Net, V  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B, T, P = 4, 30, 8


def ids_of(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_return_path_cut_is_the_forget_only_curve(kind, scale) -> None:
    cut = return_cut(gatelens.Lens(Net(kind, scale=scale)), ids_of(), P)
    assert cut.lags == [1, 2, 4, 8, 16]
    assert [c.layer for c in cut.layers] == [0, 1] and cut.pooled.layer is None
    for c in [*cut.layers, cut.pooled]:
        assert c.n == B
        for k, (m, a) in enumerate(zip(c.measured, c.forget_only, strict=True)):
            assert abs(m - a) <= 2e-6 + 1e-5 * a, (c.layer, cut.lags[k], m, a)
    assert cut.max_abs_diff < 2e-6
    assert cut.max_abs_residual < 2e-6  # every window, position and unit, not just norms
    # the uncut run has a return path (layer 1 reads layer 0's changed output): the check
    # can fail, the cut is what makes the curves meet
    assert max(abs(u - a) for u, a in zip(cut.layers[1].uncut, cut.layers[1].forget_only,
                                          strict=True)) > 1e-4
    d = cut.to_dict()
    assert d["lags"] == cut.lags and len(d["layers"]) == 2 and d["patched"]


@pytest.mark.parametrize("cell,letters", [("mingru", ["z", "keep", "cand"]),
                                          ("minlstm", ["f", "i", "keep", "cand"])])
def test_the_cut_of_gatelens_cells_and_a_given_perturbation(cell, letters) -> None:
    torch.manual_seed(0)
    lm = CharLM(vocab_size=V, hidden=H, layers=2, cell=cell).eval()
    ids = ids_of()
    pert = perturb_windows(ids, P, V, seed=3)
    cut = return_cut(gatelens.Lens(lm), ids, P, perturbed=pert)
    assert cut.max_abs_diff < 2e-6 and cut.max_abs_residual < 2e-6
    assert cut.gates == letters


class Loop(nn.Module):
    """An nn.LSTMCell stepped in a loop: the cut is Patch edits on its calls."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.cell, self.head = nn.Embedding(V, E), nn.LSTMCell(E, H), nn.Linear(H, V)

    def forward(self, ids: Tensor) -> Tensor:
        h = c = torch.zeros(ids.shape[0], H)
        out = []
        for t in range(ids.shape[1]):
            h, c = self.cell(self.embed(ids[:, t]), (h, c))
            out.append(self.head(h))
        return torch.stack(out, 1)


def test_the_cut_of_a_cell_in_a_loop_and_an_slstms_ablation() -> None:
    cut = return_cut(gatelens.Lens(Loop()), ids_of(), P)
    assert cut.max_abs_diff < 2e-6 and cut.max_abs_residual < 2e-6
    assert cut.layers[0].uncut != pytest.approx(cut.layers[0].forget_only)  # one layer:
    # the cell's gates read h, so even one layer has a return path for the cut to remove
    torch.manual_seed(0)
    lens = gatelens.Lens(CharLM(vocab_size=V, hidden=H, layers=2, cell="slstm").eval())
    with pytest.raises(GatelensError, match="slstm cell of rnn .* no return path"):
        return_cut(lens, ids_of(), P)
    ab = state_ablation(lens, ids_of(), P)
    assert ab.parts == ["h", "c", "n", "m"] and ab.kl_at_p > 0 and ab.kl[0] > 0


def test_cut_and_ablation_refuse_what_they_cannot_do() -> None:
    lens, ids = gatelens.Lens(Net("rnn")), ids_of()
    with pytest.raises(GatelensError, match="rnn_tanh cell .* no return path"):
        return_cut(lens, ids, P)
    lens = gatelens.Lens(Net("lstm"))
    with pytest.raises(GatelensError, match="p must be a position in 0..28"):
        return_cut(lens, ids, T - 1)
    with pytest.raises(GatelensError, match="p must be a position"):
        state_ablation(lens, ids, -1)
    with pytest.raises(GatelensError, match="perturbed must be ids of the shape"):
        return_cut(lens, ids, P, perturbed=ids[:, :5])
    with pytest.raises(GatelensError, match="path='nope' is not a recurrent module"):
        state_ablation(lens, ids, P, path="nope")
    with pytest.raises(GatelensError, match=r"over must be ids \(B', T'\) with T' > 8"):
        state_ablation(lens, ids, P, over=ids[:, :P])
    # the mean from other windows is another ablation; from the same windows, the same
    assert state_ablation(lens, ids, P, over=ids_of(5)).kl != state_ablation(lens, ids, P).kl
    assert state_ablation(lens, ids, P, over=ids.clone()).kl == state_ablation(lens, ids, P).kl


def _kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """KL(softmax p ‖ softmax q) per row, float64."""
    lp, lq = (torch.log_softmax(x.double(), dim=-1) for x in (p_logits, q_logits))
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("scale", [1.0, 16.0])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_state_ablation_at_lag_0_and_1_by_hand(kind, scale) -> None:
    net, ids = Net(kind, scale=scale), ids_of()
    ab = state_ablation(gatelens.Lens(net), ids, P)
    assert ab.parts == (["h", "c"] if kind == "lstm" else ["h"])
    with torch.no_grad():
        x = net.embed(ids)
        y, _ = net.rnn(x)
        clean = net.head(y)
        # every part of every layer: its mean per unit over the windows at p
        hs, cs = [], []
        inp = x
        for k in range(2):
            layer = KINDS[kind](E if k == 0 else H, H, batch_first=True)
            layer.load_state_dict({n.replace(f"_l{k}", "_l0"): p
                                   for n, p in net.rnn.state_dict().items() if f"_l{k}" in n})
            out = layer(inp)[0]
            hs.append(out[:, P].double().mean(0).float())
            if kind == "lstm":  # c of layer k, from its own cell run one step at a time
                cell = nn.LSTMCell(layer.input_size, H)
                cell.load_state_dict({n[:-3]: p for n, p in layer.state_dict().items()})
                h = c = torch.zeros(B, H)
                c_all = []
                for t in range(T):
                    h, c = cell(inp[:, t], (h, c))
                    c_all.append(c)
                cs.append(c_all[P].double().mean(0).float())
            inp = out
        at_p = net.head(hs[-1]).expand(B, V)  # position p reads the ablated last layer's h
        h0 = torch.stack(hs)[:, None].expand(2, B, H).contiguous()
        state = (h0, torch.stack(cs)[:, None].expand(2, B, H).contiguous()) if kind == "lstm" \
            else h0
        after = net.head(net.rnn(x[:, P + 1 :], state)[0])  # the module's own forward
    assert ab.kl_at_p == pytest.approx(float(_kl(clean[:, P], at_p).mean()), rel=1e-4, abs=1e-9)
    assert ab.kl[0] == pytest.approx(float(_kl(clean[:, P + 1], after[:, 0]).mean()), rel=1e-4,
                                     abs=1e-9)
    assert ab.lags == [1, 2, 4, 8, 16] and ab.kl_at_p > 0
    d = ab.to_dict()
    assert d["kl"] == ab.kl and d["ablated"] == ab.parts and "half_life" in d


def test_state_ablation_half_life_is_the_reachs() -> None:
    ab = state_ablation(gatelens.Lens(Net("gru")), ids_of(), P)
    r = ab.reach
    assert ab.half_life == pytest.approx(r.max_lag * gatelens.half_life(r.kl[-1] / r.kl[0]))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_analyzes_causal_section_is_the_lens_figures(kind) -> None:
    """report.json's causal.return_cut and causal.state_ablation (the family's own
    intervene, chunk by chunk) against return_cut and state_ablation (Lens.run) on the
    same windows and perturbation, and the cut against the report's own forget-only curve."""
    import jsonschema

    from gatelens.report.json_report import schema

    net, ids = Net(kind, scale=8.0), ids_of()
    lens = gatelens.Lens(net, vocab=list("abcdefg"))
    a = lens.analyze(ids, perturb_pos=P, exponents=0, chunk=3).analyses["rnn"]  # 2 chunks
    rep = a.report
    jsonschema.validate(rep, schema())
    cut, ab = rep["causal"]["return_cut"], rep["causal"]["state_ablation"]
    assert rep["causal"]["note"] is None
    ref = return_cut(lens, ids, P, perturbed=a.perturbed)
    assert cut["lags"] == ref.lags == rep["perturbation"]["lags"]
    for got, want in zip([*cut["layers"], cut["pooled"]], [*ref.layers, ref.pooled],
                         strict=True):
        assert got["layer"] == want.layer and got["n"] == want.n
        assert got["measured"] == pytest.approx(want.measured, rel=1e-5, abs=1e-7)
        assert got["forget_only"] == pytest.approx(want.forget_only, rel=1e-5, abs=1e-7)
    assert cut["pooled"]["forget_only"] == pytest.approx(rep["perturbation"]["forget_only"],
                                                         rel=1e-6, abs=1e-9)
    assert cut["pooled"]["measured"] == pytest.approx(cut["pooled"]["forget_only"], rel=1e-5,
                                                      abs=2e-6)
    assert cut["max_abs_diff"] < 2e-6
    want = state_ablation(lens, ids, P)
    assert ab["n"] == B and ab["lags"] == want.lags
    assert ab["kl_at_p"] == pytest.approx(want.kl_at_p, rel=1e-5)
    assert ab["kl"] == pytest.approx(want.kl, rel=1e-4, abs=1e-12)


def test_analyze_goes_on_when_the_family_refuses_the_edit(monkeypatch) -> None:
    lens = gatelens.Lens(Net("gru"))

    def refuse(*args, **kwargs):
        raise RuntimeError("no step\n here")

    monkeypatch.setattr(type(lens.families["rnn"]), "intervene", refuse)
    a = lens.analyze(ids_of(), perturb_pos=P, exponents=0).analyses["rnn"]
    causal = a.report["causal"]
    assert causal == {"return_cut": None, "state_ablation": None,
                      "note": "RuntimeError: no step here"}
    assert a.report["perturbation"]["forget_only"]  # the rest of the analysis stands


def test_analyze_leaves_causal_null_for_a_plain_rnns_cut() -> None:
    a = gatelens.Lens(Net("rnn")).analyze(ids_of(), perturb_pos=P, exponents=0).analyses["rnn"]
    causal = a.report["causal"]
    assert causal["return_cut"] is None and causal["state_ablation"]["lags"] == [1, 2, 4, 8, 16]


class PerStep(nn.Module):
    """An nn.LSTM called one step a call, the state handed back: analyze stitches its calls,
    and the ablation's hook counts them (call n is position n)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.rnn, self.head = nn.Embedding(V, E), nn.LSTM(E, H, 2), nn.Linear(H, V)

    def forward(self, ids: Tensor) -> Tensor:
        state, out = None, []
        for t in range(ids.shape[1]):
            y, state = self.rnn(self.embed(ids[:, t : t + 1]).transpose(0, 1), state)
            out.append(self.head(y[0]))
        return torch.stack(out, 1)


def test_analyzes_causal_section_of_a_module_called_one_step_a_call() -> None:
    lens, ids = gatelens.Lens(PerStep(), vocab=list("abcdefg")), ids_of()
    a = lens.analyze(ids, perturb_pos=P, exponents=0).analyses["rnn"]
    causal = a.report["causal"]
    assert causal["note"] is None
    ref = return_cut(lens, ids, P, perturbed=a.perturbed)
    assert causal["return_cut"]["pooled"]["measured"] == pytest.approx(ref.pooled.measured,
                                                                       rel=1e-5, abs=1e-7)
    assert ref.max_abs_diff < 2e-6
    want = state_ablation(lens, ids, P)
    assert want.kl_at_p > 0 and want.kl[0] > 0
    assert causal["state_ablation"]["kl_at_p"] == pytest.approx(want.kl_at_p, rel=1e-5)
    assert causal["state_ablation"]["kl"] == pytest.approx(want.kl, rel=1e-4, abs=1e-12)


def test_each_layers_cut_rows_are_that_layers_own_split() -> None:
    """cut_rows splits the whole stack once and takes each layer's slice of the state axis;
    a layer's rows must equal the split of that layer alone (a one-layer trace), so an
    offset or an order gone wrong is caught. Layers of different widths (an LSTM of 6
    then one of 4 units) and a cut run that differs from the uncut one."""
    from gatelens.analysis.causal import cut_rows
    from gatelens.analysis.perturbation import decay_rows, decompose
    from gatelens.readout.trace_types import Trace

    torch.manual_seed(0)
    a, b = nn.LSTM(3, 6, batch_first=True), nn.LSTM(6, 4, batch_first=True)
    x = torch.randn(3, 16, 3)
    x2, x3 = x.clone(), x.clone()
    x2[:, 4] += 1.0
    x3[:, 4] += 1.0
    x3[:, 9] -= 0.5  # the "cut" run: any other run does for the bookkeeping
    traces = []
    for inp in (x, x2, x3):
        ta, tb = gatelens.trace(a, inp), gatelens.trace(b, a(inp)[0].detach())
        traces.append(Trace("lstm", 2, False, {**ta.tensors, **{
            n.replace("layer0", "layer1"): v for n, v in tb.tensors.items()}}))
    clean, uncut, cut = traces
    rows = cut_rows(clean, uncut, cut, 4)
    for k in range(2):
        one = [Trace("lstm", 1, False, {n.replace(f"layer{k}", "layer0"): v
                                        for n, v in t.tensors.items()
                                        if n.startswith(f"layer{k}.")}) for t in traces]
        split = decay_rows(one[0], one[1], 4, decompose(one[0], one[1], 4))["rows"]
        assert torch.equal(rows["curves"][k]["measured"],
                           decay_rows(one[0], one[2], 4)["rows"]["measured"])
        assert torch.equal(rows["curves"][k]["forget_path"], split["forget_path"])
        assert torch.equal(rows["curves"][k]["uncut"], split["measured"])
    assert rows["curves"][None]["measured"].shape == (3, 12)
