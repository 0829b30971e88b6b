"""Lens on users' own models: a char LM, a GRU encoder-decoder, a bidirectional packed
classifier; the files it writes; the errors it raises."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

import gatelens
from gatelens.errors import GatelensError

WORDS = "the quick brown fox jumps over a lazy dog and then runs home".split()
_rng = random.Random(2)
TEXT = "\n".join(" ".join(_rng.choice(WORDS) for _ in range(8)) for _ in range(20))
CHARS = sorted(set(TEXT))
V = len(CHARS)
B, T, P = 3, 40, 8  # windows, length, perturbation position


pytestmark = pytest.mark.usefixtures("one_thread")


class CharLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, V)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(ids))[0])  # (B, T, V)


class EncDec(nn.Module):
    """The decoder reads the same embedding, starting from the encoder's final state."""

    def __init__(self, steps: bool | str = False) -> None:
        super().__init__()
        self.steps = steps
        self.embed = nn.Embedding(V, 16)
        self.encoder = nn.GRU(16, 20, batch_first=True)
        self.decoder = nn.GRU(16, 20, batch_first=True)
        self.head = nn.Linear(20, V)

    def forward(self, ids: Tensor) -> Tensor:
        e = self.embed(ids)  # (B, T, 16)
        _, h = self.encoder(e)  # (1, B, 20)
        if not self.steps:
            return self.head(self.decoder(e, h)[0])  # (B, T, V)
        ys = []
        for t in range(e.shape[1]):  # a decoder run step by step
            y, h_t = self.decoder(e[:, t:t + 1], h)
            h = h if self.steps == "fresh" else h_t  # "fresh": every step from the encoder's
            ys.append(y)
        return self.head(torch.cat(ys, 1))


class BiClassifier(nn.Module):
    """embedding -> packed batch -> 2-layer bidirectional LSTM -> head on the final state."""

    def __init__(self, ragged: bool = False) -> None:
        super().__init__()
        self.ragged = ragged
        self.embed = nn.Embedding(V, 8)
        self.lstm = nn.LSTM(8, 10, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(20, 3)

    def forward(self, ids: Tensor) -> Tensor:
        lengths = torch.full((ids.shape[0],), ids.shape[1])
        if self.ragged:
            lengths[0] -= 1
        packed = pack_padded_sequence(self.embed(ids), lengths, batch_first=True,
                                      enforce_sorted=False)
        _, (h, _) = self.lstm(packed)  # h: (2·2, B, 10)
        return self.head(torch.cat([h[-2], h[-1]], -1))  # (B, 3)


def windows() -> Tensor:
    index = {c: i for i, c in enumerate(CHARS)}
    return torch.tensor([[index[c] for c in TEXT[k * T:(k + 1) * T]] for k in range(B)])


def seen_by(model: nn.Module, module: nn.Module, ids: Tensor) -> tuple:
    """(input, hx) ``module`` received when ``model`` read ``ids`` (an independent hook)."""
    got = []
    handle = module.register_forward_hook(
        lambda m, args, kwargs, out: got.append((args[0], args[1] if len(args) > 1 else None)),
        with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return got[0]


def test_char_lm_lstm_measured_through_the_model() -> None:
    torch.manual_seed(0)
    model = CharLM().train()
    result = gatelens.Lens(model, vocab=CHARS).analyze(TEXT, windows=B, length=T,
                                                       perturb_pos=P)
    assert list(result.reports) == ["lstm"]
    rep = result.reports["lstm"]
    assert rep["model"]["path"] == "lstm" and rep["model"]["class"] == "CharLM"
    assert rep["model"]["cell"] == "lstm" and rep["model"]["layers"] == 2
    assert rep["verification"]["passed"] is True
    a = result.analyses["lstm"]
    assert torch.equal(a.windows, windows())
    assert a.reach is not None and a.reach.lags[0] == 1 and a.reach.kl[0] > 0
    x, _ = seen_by(model, model.lstm, windows())
    assert torch.equal(x, model.embed(windows()).detach())
    own = gatelens.trace(model.lstm, x)
    for g in "ifgoch":
        assert torch.equal(a.trace[f"layer1.{g}"], own[f"layer1.{g}"]), g
    assert model.training and model.lstm.training  # the training flags are restored


def test_encoder_decoder_decoder_sees_the_encoder_state() -> None:
    torch.manual_seed(1)
    model = EncDec()
    lens = gatelens.Lens(model, vocab=CHARS)
    p = T - 3  # near the end, so the encoder's final state still carries the change
    result = lens.analyze(windows(), perturb_pos=p)
    assert sorted(result.reports) == ["decoder", "encoder"]
    enc, dec = result.analyses["encoder"], result.analyses["decoder"]
    cap = lens.runner("decoder")(windows())
    with torch.no_grad():
        h_n = model.encoder(model.embed(windows()))[1]  # (1, B, 20) PyTorch's own
    assert torch.equal(cap.state, h_n)
    assert torch.equal(seen_by(model, model.decoder, windows())[1], h_n)
    assert torch.allclose(enc.trace.h_n, h_n, atol=1e-6)  # the encoder's own trace agrees
    assert dec.reach is not None and enc.reach is not None
    # before p, the encoder's states are untouched; the decoder's move (through h_n)
    before = slice(0, p)
    assert torch.equal(enc.trace["layer0.h"][:, before],
                       enc.trace_perturbed["layer0.h"][:, before])
    moved = (dec.trace["layer0.h"][:, before] - dec.trace_perturbed["layer0.h"][:, before])
    assert float(moved.abs().max()) > 1e-4
    assert all(r["verification"]["passed"] for r in result.reports.values())


@pytest.mark.parametrize("steps", [False, True])
def test_capture_reads_every_module_from_one_forward(steps, capsys) -> None:
    """``Lens.capture``: the encoder's input and the decoder's (its initial state the
    encoder's final one; a decoder stepped in a loop stitched into one trajectory) from one
    forward, the same as each module's own runner; ``analyze(progress=True)`` names each
    module as it is measured."""
    torch.manual_seed(1)
    model = EncDec(steps)
    lens = gatelens.Lens(model, vocab=CHARS)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    seen = lens.capture(windows())
    assert sorted(seen) == ["decoder", "encoder"] and len(forwards) == 1
    for path, got in seen.items():
        alone = lens.runner(path)(windows())
        assert torch.equal(got.logits, alone.logits)
        if steps and path == "decoder":  # a stitched trajectory: its steps' inputs and state
            assert torch.equal(got.inputs.inputs, alone.inputs.inputs)
            assert all(torch.equal(a, b) for a, b in zip(got.inputs.state, alone.inputs.state,
                                                          strict=True))
            assert all(torch.equal(a, b) for a, b in zip(got.inputs.steps, alone.inputs.steps,
                                                          strict=True))
        else:
            assert torch.equal(got.inputs, alone.inputs)
            assert (got.state is None) == (alone.state is None)
            assert got.state is None or torch.equal(got.state, alone.state)
    if not steps:
        assert torch.equal(seen["decoder"].state, seen_by(model, model.decoder, windows())[1])


def test_analyze_names_each_module_and_measures_the_context_used_once(capsys, monkeypatch
                                                                      ) -> None:
    """``analyze(progress=True)`` names each module as it is measured; the context used, the
    whole model's truncated runs, is measured for the first module and handed to the next
    (one pass of truncated runs for two modules), the same figures as measured alone."""
    from gatelens.analysis.context import ContextAccumulator

    torch.manual_seed(1)
    lens = gatelens.Lens(EncDec(), vocab=CHARS)
    passes = []
    real = ContextAccumulator.update
    monkeypatch.setattr(ContextAccumulator, "update",
                        lambda self, ids: (passes.append(1), real(self, ids))[1])
    result = lens.analyze(windows(), perturb_pos=4, exponents=0, progress=True)
    err = capsys.readouterr().err
    assert "gatelens analyze: encoder (module 1 of 2)" in err
    assert "gatelens analyze: decoder (module 2 of 2)" in err
    assert len(passes) == 1
    enc, dec = (result.reports[p]["context"] for p in ("encoder", "decoder"))
    alone = lens.measure("decoder", windows(), CHARS, perturb_pos=4, exponents=0)
    assert enc == dec and len(passes) == 2
    assert alone.context.to_dict().items() <= dec.items()  # dec: its words beside them


def test_bidirectional_packed_classifier() -> None:
    torch.manual_seed(2)
    model = BiClassifier()
    lens = gatelens.Lens(model, vocab=CHARS)
    result = lens.analyze(TEXT, windows=B, length=T, perturb_pos=P)
    a, rep = result.analyses["lstm"], result.reports["lstm"]
    assert rep["verification"]["passed"] is True
    assert a.reach is None and "not next-token logits" in a.reach_note
    assert "forward direction measured" in rep["model"]["directions"]
    cap = lens.runner("lstm")(windows())
    assert isinstance(cap.inputs, Tensor)  # unpacked, in the caller's order
    assert torch.equal(cap.inputs, model.embed(windows()).detach())
    # state measurements read the forward direction's layers only (2 layers × 10 units)
    assert a.units.n_units == 20
    fwd = torch.cat([a.trace["layer0.f"], a.trace["layer1.f"]], -1).double().mean()
    assert a.units.forget_means.mean() == pytest.approx(float(fwd), rel=1e-9)
    assert "layer1.reverse.f" in a.trace and "forward direction measured" in result.index_html
    with pytest.raises(GatelensError, match=r"lengths 39\.\.40"):
        gatelens.Lens(BiClassifier(ragged=True), vocab=CHARS).analyze(windows(),
                                                                       perturb_pos=P)


def test_unidirectional_reports_have_no_directions() -> None:
    torch.manual_seed(3)
    rnn = nn.RNN(V, 6, batch_first=True)
    lens = gatelens.Lens(rnn, encode=lambda i: nn.functional.one_hot(i, V).float())
    result = lens.analyze(windows(), perturb_pos=P)
    rep = result.reports[""]
    assert rep["model"]["cell"] == "rnn" and rep["model"]["nonlinearity"] == "tanh"
    assert "directions" not in rep["model"]
    assert result.analyses[""].chars == [f"<{i}>" for i in range(int(windows().max()) + 1)]


def test_out_writes_reports_and_index(tmp_path: Path) -> None:
    torch.manual_seed(4)
    result = gatelens.Lens(EncDec(), vocab=CHARS).analyze(
        TEXT, windows=B, length=T, perturb_pos=P, out=tmp_path)
    for d in ("encoder", "decoder"):
        for name in ("report.json", "report.md", "report.html"):
            assert (tmp_path / d / name).is_file(), (d, name)
        assert json.loads((tmp_path / d / "report.json").read_text())["model"]["path"] == d
    index = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert index == result.index_html
    assert 'href="encoder/report.html"' in index and 'href="decoder/report.html"' in index
    assert "http://" not in index and "https://" not in index
    assert result._repr_html_().startswith("<iframe srcdoc=")
    assert result.out == tmp_path


def test_model_that_is_the_module_writes_to_model_dir(tmp_path: Path) -> None:
    torch.manual_seed(5)
    lens = gatelens.Lens(nn.GRU(V, 5, batch_first=True),
                         encode=lambda i: nn.functional.one_hot(i, V).float(), vocab=V)
    lens.analyze(windows(), perturb_pos=P, out=tmp_path)
    assert (tmp_path / "model" / "report.json").is_file()
    assert 'href="model/report.html"' in (tmp_path / "index.html").read_text()


def test_errors() -> None:
    with pytest.raises(GatelensError, match="Sequential: nothing in it is a recurrence"):
        gatelens.Lens(nn.Sequential(nn.Linear(2, 2)))
    lens = gatelens.Lens(CharLM(), vocab=CHARS)
    with pytest.raises(GatelensError, match=r"character 'Z' at position 5 "):
        lens.analyze("the qZ" + TEXT, windows=B, length=T, perturb_pos=P)
    with pytest.raises(GatelensError, match="too short for 3 windows of 40"):
        lens.analyze(TEXT[:100], windows=B, length=T, perturb_pos=P)
    with pytest.raises(GatelensError, match="text input needs vocab"):
        gatelens.Lens(CharLM()).analyze(TEXT, windows=B, length=T)
    time_first = nn.Sequential(nn.Embedding(V, 4), nn.GRU(4, 5))  # reads (B, T, 4) as (T, B)
    with pytest.raises(GatelensError, match=r"^GRU read 40 sequences of 3 steps from 3 windows "
                                            r"of 40 characters: .* batch_first=False"):
        gatelens.Lens(time_first, vocab=CHARS).analyze(windows(), perturb_pos=P)
    with pytest.raises(GatelensError, match="decoder: its 40 calls in one forward form 40 "
                                            "trajectories .*call 1's state is not call 0's"):
        gatelens.Lens(EncDec(steps="fresh"), vocab=CHARS).analyze(windows(), perturb_pos=P)


def test_chaotic_model_passes_and_says_so(tmp_path: Path, seeded_rerun) -> None:
    """An LSTM with weights x16 is chaotic: each step is still PyTorch's (one-step check
    passes), the free-running figure (its re-run seeded one ulp off, so on every CPU) is
    large and explained, λ > 0, and the report reads the perturbation as growing rather
    than giving a half-life."""
    torch.manual_seed(0)
    model = CharLM()
    with torch.no_grad():
        for name, p in model.lstm.named_parameters():
            if name.startswith("weight"):
                p.mul_(16)
    ids = torch.randint(0, V, (4, 48), generator=torch.Generator().manual_seed(1))
    result = gatelens.Lens(model, vocab=CHARS).analyze(ids, windows=4, length=48,
                                                       perturb_pos=12, out=tmp_path)
    rep = result.reports["lstm"]
    v = rep["verification"]
    assert v["passed"] and v["one_step_max_abs_diff_h"] < 1e-5
    assert v["free_running_max_abs_diff_h"] > 1e-3 and "chaotic" in v["explanation"]
    assert rep["divergence"]["regime"] == "chaotic" and rep["divergence"]["lyapunov_per_char"] > 0
    # the trace handed back is the module's own trajectory, not the free-running one
    a = result.analyses["lstm"]
    with torch.no_grad():
        out, _ = model.lstm(model.embed(ids))
    assert (a.trace["layer1.h"] - out).abs().max() <= 1e-5
    md = (tmp_path / "lstm" / "report.md").read_text()
    assert "chaotic" in md
