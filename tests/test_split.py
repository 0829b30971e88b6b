"""The perturbation's split read one layer at a time (analysis/split.py) against the same
split computed on the whole stack's pooled state, and what the analysis keeps of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis import measurements
from gatelens.analysis.causal import cut_rows
from gatelens.analysis.common import pooled
from gatelens.analysis.measure import encoder_runner, measure
from gatelens.analysis.perturbation import decay_rows, perturb_windows
from gatelens.analysis.split import Split, decompose, perturbed_letters, perturbed_part
from gatelens.readout.trace import trace
from gatelens.report.html_data import page_data


def _traces(cls, layers=3, B=4, T=24, p=5, scale=1.0):
    torch.manual_seed(layers)
    m = cls(6, 9, num_layers=layers, batch_first=True)
    with torch.no_grad():
        for w in m.parameters():
            w.mul_(scale)
    ids = torch.randint(0, 6, (B, T), generator=torch.Generator().manual_seed(2))
    ids2 = perturb_windows(ids, p, 6, seed=1)
    onehot = lambda i: nn.functional.one_hot(i, 6).float()  # noqa: E731
    with torch.no_grad():
        return trace(m, onehot(ids)), trace(m, onehot(ids2)), p


def _pooled_split(tr, tr2, p):
    """The split on the pooled state of every layer at once, written out here."""
    s, s2 = (pooled(t, tr.state_name).double() for t in (tr, tr2))
    f = pooled(tr, tr.keep_gate).double()
    d = s2 - s
    d[:, :p] = 0
    forget = torch.zeros_like(d)
    forget[:, p] = d[:, p]
    for t in range(p + 1, d.shape[1]):
        forget[:, t] = f[:, t] * forget[:, t - 1]
    return d, forget


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("scale", [1.0, 8.0])  # ×8: a chaotic LSTM
def test_the_split_by_layer_is_the_split_of_the_pooled_state(cls, scale):
    tr, tr2, p = _traces(cls, scale=scale)
    split = Split.of(tr, tr2, p)
    whole = split.whole()
    d, forget = _pooled_split(tr, tr2, p)
    assert torch.equal(whole["measured"], d)
    assert torch.equal(whole["forget_path"], forget)  # the same products, in the same order
    # the two paths add up to δs up to the float32 rounding of the traced values
    assert torch.allclose(whole["forget_path"] + whole["return_path"], d, atol=1e-5, rtol=1e-5)
    # the pooled curves from the layers' sums of squares are the norms of the pooled arrays
    rows = decay_rows(tr, tr2, p, split)["rows"]
    keep = d[:, p].norm(dim=-1) > 0
    base = d[keep, p].norm(dim=-1)[:, None]
    for name, v in (("measured", d), ("forget_path", forget),
                    ("return_path", whole["return_path"])):
        want = v[keep, p:].norm(dim=-1) / base
        assert torch.allclose(rows[name], want, rtol=1e-12, atol=0), name
    # the dict a caller already has gives the same rows as the split read by layer
    again = decay_rows(tr, tr2, p, decompose(tr, tr2, p))["rows"]
    assert all(torch.allclose(again[n], rows[n], rtol=1e-14, atol=0) for n in rows)


def test_the_cut_rows_by_layer_are_the_pooled_ones():
    tr, tr2, p = _traces(nn.LSTM)
    split = Split.of(tr, tr2, p)
    rows = cut_rows(tr, tr2, tr2, p, split)  # the uncut run as its own "cut": δs_cut = δs
    d, forget = _pooled_split(tr, tr2, p)
    keep = d[:, p].norm(dim=-1) > 0
    want = forget[keep, p:].norm(dim=-1) / d[keep, p].norm(dim=-1)[:, None]
    assert torch.allclose(rows["curves"][None]["forget_path"], want, rtol=1e-12, atol=0)
    assert rows["residual"] == pytest.approx(float((d - forget)[:, p:].abs().max()), rel=1e-12)
    assert rows["scale"] == pytest.approx(float(forget[:, p].norm(dim=-1).max()), rel=1e-12)
    width = tr["layer0.c"].shape[-1]
    layer0 = forget[keep, p:, :width].norm(dim=-1) / d[keep, p, :width].norm(dim=-1)[:, None]
    assert torch.allclose(rows["curves"][0]["forget_path"], layer0, rtol=1e-12, atol=0)


def _analysis(monkeypatch, kept):
    monkeypatch.setattr(measurements, "SPLIT_KEPT", kept)
    torch.manual_seed(0)
    m = nn.LSTM(3, 4, num_layers=2, batch_first=True)
    run = encoder_runner(lambda i: nn.functional.one_hot(i, 3).float())
    ids = torch.randint(0, 3, (3, 12), generator=torch.Generator().manual_seed(0))
    return measure(m, run, ids, list("ab "), perturb_pos=4)


def test_the_analysis_keeps_the_split_of_the_windows_that_fit(monkeypatch):
    full = _analysis(monkeypatch, measurements.SPLIT_KEPT)
    assert full.decomposition["measured"].shape == (3, 12, 8)
    one = 12 * 8 * 8 * 3  # the bytes of one window's three paths (T · S · 8 · 3)
    part = _analysis(monkeypatch, one + 1)
    assert part.decomposition["measured"].shape == (1, 12, 8)
    assert torch.equal(part.decomposition["return_path"], full.decomposition["return_path"][:1])
    # the curves are every window's, whatever is kept for the page
    assert part.perturbation.return_path == full.perturbation.return_path
    assert page_data(part, max_windows=1)["perturb"]["has_paths"]
    shown = page_data(part, max_windows=3)["perturb"]
    assert not shown["has_paths"] and set(shown["paths"]) == {"measured"}
    none = _analysis(monkeypatch, one - 1)
    assert none.decomposition is None and none.perturbation.forget_only is not None
    assert not page_data(none)["perturb"]["has_paths"]


def test_a_page_over_budget_draws_the_first_units_of_each_layer(monkeypatch):
    from gatelens.report import html_data
    from gatelens.report.html_data import dequantize

    a = _analysis(monkeypatch, measurements.SPLIT_KEPT)  # 2 layers of 4 units, T = 12, p = 4
    assert page_data(a)["meta"]["units_shown"] is None  # the seed's sizes draw every unit
    per_unit = 2 * (2 * 12 * 6 + 3 * 8)  # 2 layers: 6 signals of both models, 3 paths
    monkeypatch.setattr(html_data, "BYTE_BUDGET", 2 * per_unit)  # 2 units a layer
    monkeypatch.setattr(html_data, "MIN_UNITS", 1)
    d = page_data(a)
    assert d["meta"]["units_shown"] == 2 and d["meta"]["shown"] == 1
    assert "the first 2 units of each layer" in d["title"]
    assert d["models"]["trained"]["layer1"]["c"]["shape"] == [1, 12, 2]
    assert all(len(v) == 2 for tab in d["units"].values() for v in tab.values()
               if isinstance(v, list))
    paths = dequantize(d["perturb"]["paths"]["forget_path"])  # (1, T − p, 2 layers × 2)
    want = a.decomposition["forget_path"][0, 4:, [0, 1, 4, 5]].numpy()
    span = np.ptp(want, axis=0).max()
    assert paths.shape == (1, 8, 4) and np.abs(paths[0] - want).max() <= span / 500


def test_an_analysis_over_its_trace_budget_keeps_the_first_units_for_the_page(monkeypatch):
    from gatelens.analysis import result

    full = _analysis(monkeypatch, measurements.SPLIT_KEPT)
    column = 2 * len(full.trace) * 12 * 4  # one unit of every tensor of both traces
    monkeypatch.setattr(result, "TRACES_KEPT", 3 * column)  # 3 units of one window
    a = _analysis(monkeypatch, measurements.SPLIT_KEPT)
    assert a.trace.meta["kept_units"] == 3 and a.trace["layer1.c"].shape == (1, 12, 3)
    assert torch.equal(a.trace["layer1.f"], full.trace["layer1.f"][:1, :, :3])
    # the figures are every window's and unit's, whatever is kept for the page
    assert a.perturbation.return_path == full.perturbation.return_path
    assert a.units.forget_means.tolist() == full.units.forget_means.tolist()
    d = page_data(a)
    assert d["meta"]["units_shown"] == 3 and d["meta"]["shown"] == 1
    assert all(len(v) == 3 for tab in d["units"].values() for v in tab.values()
               if isinstance(v, list))
    paths = d["perturb"]["paths"]
    assert set(paths) == {"measured"} and paths["measured"]["shape"] == [1, 8, 6]


def _small(transformers, kind: str, lm: bool, vocab: int, layers: int, hidden: int,
           head_dim: int, chunk: int, **mamba2):
    """A small random transformers Mamba ("mamba") or Mamba-2 ("mamba2"), its causal LM or
    its backbone, seeded 0."""
    torch.manual_seed(0)
    if kind == "mamba":
        cls = transformers.MambaForCausalLM if lm else transformers.MambaModel
        return cls(transformers.MambaConfig(vocab_size=vocab, hidden_size=hidden, state_size=4,
                                            num_hidden_layers=layers, expand=2,
                                            use_cache=False)).eval()
    cls = transformers.Mamba2ForCausalLM if lm else transformers.Mamba2Model
    return cls(transformers.Mamba2Config(
        vocab_size=vocab, hidden_size=hidden, state_size=4, num_hidden_layers=layers,
        num_heads=4, head_dim=head_dim, expand=2, n_groups=1, chunk_size=chunk,
        use_cache=False, **mamba2)).eval()


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_an_edited_run_gives_only_the_names_kept(kind, monkeypatch):
    """``EditPlan(keep=...)``: the return path cut reads the states alone, and transformers'
    Mamba and Mamba-2 leave the other signals out (the same states as a run that keeps
    all): the steps hand over only the names kept, whole (B, T − first, W) tensors."""
    transformers = pytest.importorskip("transformers")
    from gatelens.families import official_edit
    from gatelens.families.edit_plan import EditPlan, StepChange
    from gatelens.families.registry import open_family

    m = _small(transformers, kind, lm=False, vocab=9, layers=2, hidden=8, head_dim=4, chunk=4)
    fam = open_family(m)
    call = fam.check(torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1)))
    handed: list[dict] = []
    for name in ("_steps", "layer_steps"):
        run = getattr(official_edit, name)
        monkeypatch.setattr(official_edit, name, lambda *a, _run=run: (
            lambda out: handed.append(out[0]) or out)(_run(*a)))

    def plan(keep=None, output=True):
        half = lambda t, v: 0.5 * v  # noqa: E731  (position, value)
        return EditPlan([StepChange("layer0", "a", frozenset(range(3, 6)), True, half)],
                        keep=keep, output=output)

    _, every = fam.intervene(call, plan(), None, 0)
    _, some = fam.intervene(call, plan(["layer1.s"]), None, 0)
    assert set(some) == {"layer1.s"} and len(every) == len(fam.names()) > 4
    assert all(torch.equal(some[n], every[n]) for n in some)
    assert set(handed[1]) == {"layer1.s"} and handed[1]["layer1.s"].shape[:2] == (2, 3)
    # output=False: the kept signals alone, no layer above the last one kept is run
    ran: list[int] = []
    pre = fam.pre
    monkeypatch.setattr(fam, "pre", lambda k, *a: ran.append(k) or pre(k, *a))
    out, low = fam.intervene(call, plan(["layer0.s"], output=False), None, 0)
    assert out is None and set(low) == {"layer0.s"} and set(ran) == {0}
    assert torch.equal(low["layer0.s"], every["layer0.s"])
    with pytest.raises(ValueError, match="neither its output nor its signals"):
        EditPlan([], signals=False, output=False)


def test_an_analysis_with_cut_traces_writes_its_report(monkeypatch, tmp_path):
    """The whole report (report.json, report.md, the page) of an analysis whose traces were
    cut for the page (``TRACES_KEPT``) is written, and the page says what it draws."""
    import json

    import gatelens
    from gatelens.analysis import result

    monkeypatch.setattr(result, "TRACES_KEPT", 2048)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4), nn.LSTM(4, 6, num_layers=2, batch_first=True))
    lens = gatelens.Lens(model, vocab=list("abcde"))
    res = lens.analyze("abcdeedcba" * 40, out=tmp_path, windows=3, length=24,
                       perturb_pos=6, exponents=0)
    (a,) = res.analyses.values()
    assert a.trace.meta["kept_units"] < 6
    out = next(tmp_path.rglob("report.json"))
    assert json.loads(out.read_text())["units"]
    page = (out.parent / "report.html").read_text()
    assert f"the first {a.trace.meta['kept_units']} units of each layer drawn" in page


def _mamba_traces(layers=2, B=3, T=20, p=6):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    m = transformers.MambaModel(transformers.MambaConfig(
        vocab_size=11, hidden_size=8, state_size=4, num_hidden_layers=layers, expand=2,
        conv_kernel=3, use_cache=False)).eval()
    ids = torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(4))
    ids2 = perturb_windows(ids, p, 11, seed=2)
    with torch.no_grad():
        return trace(m, ids), trace(m, ids2), p


def test_an_official_familys_return_path_is_its_write_difference():
    """Mamba's write is read from its states, e_t = s_t − a_t ⊙ s_{t−1}: the split's input
    term δs_t − a_t ⊙ δs_{t−1} (the clean keep alone) is the perturbed run's keep and write
    against the clean run's, u_t = (a'_t − a_t) ⊙ s'_{t−1} + e'_t − e_t, written out here
    from both runs' a; the perturbed run's a is not read."""
    tr, tr2, p = _mamba_traces()
    assert "a" not in perturbed_letters(tr) and perturbed_letters(tr) == {"s", "y"}
    light = perturbed_part(tr2)
    assert {n.split(".")[1] for n in light} == {"s", "y"} and "layer1.a" in tr2
    split = Split.of(tr, light, p)
    for k in range(2):
        s, s2 = (t[f"layer{k}.s"].double() for t in (tr, tr2))
        a, a2 = (t[f"layer{k}.a"].double() for t in (tr, tr2))
        units = tr.meta.get("state_units")
        assert units is None or torch.equal(units[k], torch.arange(s.shape[-1]))
        prev = lambda v: torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1)  # noqa: E731
        e, e2 = s - a * prev(s), s2 - a2 * prev(s2)
        ret = torch.zeros_like(s)
        for t in range(p + 1, s.shape[1]):
            u = (a2[:, t] - a[:, t]) * s2[:, t - 1] + e2[:, t] - e[:, t]
            ret[:, t] = a[:, t] * ret[:, t - 1] + u
        got = split.layer(k)["return_path"]
        scale = float((s2 - s).abs().max())
        assert scale > 1e-5 and float((got - ret).abs().max()) <= 1e-12 * scale
        assert float(got[:, p + 1 :].abs().max()) > 0.1 * scale  # a return path to see


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_a_light_perturbed_trace_gives_the_same_split(cls):
    """LSTM and GRU write through their gates: the perturbed trace keeps f, i, g (z, n)."""
    tr, tr2, p = _traces(cls, scale=8.0)
    light = perturbed_part(tr2)
    assert len(light) < len(tr2)
    a, b = Split.of(tr, tr2, p).whole(), Split.of(tr, light, p).whole()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_an_analysis_keeps_the_perturbed_runs_states_and_outputs():
    """``measure`` holds the perturbed run's trace as its measurements read it."""
    transformers = pytest.importorskip("transformers")
    import gatelens

    torch.manual_seed(0)
    m = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=13, hidden_size=8, state_size=4, num_hidden_layers=2, expand=2,
        use_cache=False)).eval()
    lens = gatelens.Lens(m, vocab=[chr(97 + i) for i in range(13)])
    ids = torch.randint(0, 13, (2, 24), generator=torch.Generator().manual_seed(1))
    (path,) = list(lens.families)[:1]
    a = lens.measure(path, ids, [chr(97 + i) for i in range(13)], perturb_pos=6, exponents=0)
    assert set(a.trace_perturbed) == {f"layer{k}.{n}" for k in range(2) for n in "sy"}
    assert "layer1.a" in a.trace and a.perturbation.return_path is not None


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_the_perturbed_run_is_replayed_a_layer_at_a_time(kind, monkeypatch):
    """A Mamba or Mamba-2 stack's perturbed run is read layer by layer as the split and the
    cut read it (``LayerReplay``: one layer held, each replayed once in layer order): the
    analysis is the one the whole perturbed trace gives, figure for figure."""
    import json

    transformers = pytest.importorskip("transformers")
    import gatelens
    from gatelens.analysis import measure as measure_mod
    from gatelens.families import official_layers

    m = _small(transformers, kind, lm=True, vocab=13, layers=3,
               hidden=8 if kind == "mamba" else 16, head_dim=8, chunk=8, conv_kernel=3)
    vocab = [chr(97 + i) for i in range(13)]
    ids = torch.randint(0, 13, (3, 24), generator=torch.Generator().manual_seed(1))
    lens = gatelens.Lens(m, vocab=vocab)
    (path,) = list(lens.families)[:1]
    replays: list[int] = []
    replay = official_layers.LayerReplay._replay
    monkeypatch.setattr(official_layers.LayerReplay, "_replay",
                        lambda self, k: replays.append(k) or replay(self, k))

    def analyse():
        a = lens.measure(path, ids, vocab, perturb_pos=6, exponents=0, chunk=1)
        return a, json.dumps(a.report, sort_keys=True, default=str)

    lazy, text = analyse()
    assert replays[:3] == [0, 1, 2]  # the split reads the layers in order, once each
    assert isinstance(lazy.trace_perturbed.tensors, dict)  # the page's copy is held whole
    monkeypatch.setattr(measure_mod, "streams", lambda fam: False)
    whole, text_whole = analyse()
    assert text == text_whole
    assert set(lazy.trace_perturbed) == set(whole.trace_perturbed)
    for n in whole.trace_perturbed:
        assert torch.equal(lazy.trace_perturbed[n], whole.trace_perturbed[n]), n


def _mamba2_traces(B=3, T=20, p=6):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    m = transformers.Mamba2Model(transformers.Mamba2Config(
        vocab_size=11, hidden_size=16, state_size=4, num_hidden_layers=2, num_heads=4,
        head_dim=8, expand=2, n_groups=1, conv_kernel=3, chunk_size=8, use_cache=False)).eval()
    ids = torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(4))
    ids2 = perturb_windows(ids, p, 11, seed=2)
    with torch.no_grad():
        return trace(m, ids), trace(m, ids2), p


@pytest.mark.parametrize("kind", ["lstm", "gru", "mamba2"])
def test_a_layer_split_in_blocks_of_coordinates_is_the_whole_layers(kind, monkeypatch):
    """An element-wise keep acts on each coordinate alone: a layer's split read in blocks
    of coordinates (``Split.parts``; Mamba-2's keep gathered per head) gives the whole
    layer's split block for block, and the decay's and the cut's rows its norms."""
    from gatelens.analysis import split as split_mod

    tr, tr2, p = (_mamba2_traces() if kind == "mamba2" else
                  _traces(nn.LSTM if kind == "lstm" else nn.GRU, scale=8.0))
    whole = Split.of(tr, tr2, p)
    rows, cut = decay_rows(tr, tr2, p, whole), cut_rows(tr, tr2, tr2, p, whole)
    B, T = tr[f"layer0.{tr.state_name}"].shape[:2]
    monkeypatch.setattr(split_mod, "BLOCK_BYTES", 8 * B * T * 3)  # three coordinates a block
    split = Split.of(tr, tr2, p)
    for k, width in enumerate(split.widths):
        blocks = split.blocks(k)
        assert len(blocks) == -(-width // 3) > 1 and blocks[-1].stop == width
        layer = whole.layer(k)
        for block, part in zip(blocks, split.parts(k), strict=True):
            assert all(torch.equal(part[n], layer[n][..., block]) for n in part), (k, block)
    got, got_cut = decay_rows(tr, tr2, p, split), cut_rows(tr, tr2, tr2, p, split)
    assert got["residual"] == rows["residual"] and got_cut["residual"] == cut["residual"]
    for n, v in rows["rows"].items():
        assert torch.allclose(got["rows"][n], v, rtol=1e-12, atol=0), n
    for k, curves in cut["curves"].items():
        for n, v in curves.items():
            assert torch.allclose(got_cut["curves"][k][n], v, rtol=1e-12, atol=0), (k, n)
