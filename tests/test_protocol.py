"""Settings as one object and measurements as one protocol (docs/design.md §4).

A measurement added to ``MEASUREMENTS`` is built once, handed every chunk, timed under its
stage and asked for its result; every ``Analysis`` field a measurement fills is filled by
exactly one of them; ``AnalysisSettings`` given as an object or as keyword arguments is the
same analysis; a bad setting is one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import gatelens
from gatelens.analysis import measure as measure_mod
from gatelens.analysis import perturb_windows
from gatelens.analysis.chunk import Setup
from gatelens.analysis.measure import STAGES, Analysis, encoder_runner, measure
from gatelens.analysis.measurements import MEASUREMENTS
from gatelens.analysis.settings import DEFAULTS, AnalysisSettings
from gatelens.errors import GatelensError

V = 4


def _measure(**kw):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(V, 6, batch_first=True)
    ids = torch.randint(0, V, (5, 20), generator=torch.Generator().manual_seed(1))
    head = torch.nn.Linear(6, V)
    enc = encoder_runner(lambda i: F.one_hot(i, V).float(),
                         lambda i: head(lstm(F.one_hot(i, V).float())[0]))
    return measure(lstm, enc, ids, list("abcd"), **kw)


class Counting:
    """A measurement written the way a new one would be: counts the windows it was handed."""

    stage, report = "counting", ()
    built: list = []

    def __init__(self, setup: Setup) -> None:
        self.windows, self.chunks = 0, 0
        Counting.built.append(setup.windows)

    @classmethod
    def build(cls, setup: Setup) -> Counting:
        return cls(setup)

    def update(self, chunk) -> None:
        self.windows += len(chunk.windows)
        self.chunks += 1
        assert chunk.trace is not None and chunk.reference is not None

    def result(self, found: dict) -> dict:
        assert "gates" in found  # the measurements before it have answered
        return {"text": {"counted": [self.windows, self.chunks]}}


def test_a_new_measurement_is_one_line_in_the_list(monkeypatch) -> None:
    Counting.built.clear()
    monkeypatch.setattr(measure_mod, "MEASUREMENTS", (*MEASUREMENTS, Counting))
    clock: dict = {}
    a = _measure(perturb_pos=4, chunk=2, exponents=2, timings=clock)
    assert Counting.built == [5]  # built once per analysis
    assert a.text["counted"] == [5, 3]  # every window, in 3 chunks of at most 2
    assert clock["counting"] >= 0 and set(STAGES) <= set(clock)
    assert a.text["chunks"] == 3


def test_every_field_is_one_measurements() -> None:
    a = _measure(perturb_pos=4, exponents=2, fixed_points=True)
    own = {"model", "text", "chars", "windows", "perturbed", "perturb_pos", "trace",
           "trace_perturbed", "history", "control", "best_step", "out", "plots"}
    fields = {f.name for f in dataclasses.fields(Analysis)} - own
    assert a.lyapunov is not None and a.fixed_points is not None and a.context is not None
    assert a.reach is not None and a.divergence is not None and a.saturation is not None
    setup = Setup(None, None, 5, 20, DEFAULTS, 0, list("abcd"), 0.5, None)
    names = [m.__name__ for m in MEASUREMENTS]
    assert len(names) == len(set(names))
    stages = {m.stage for m in MEASUREMENTS}
    assert stages <= set(STAGES)
    sections = [s for m in MEASUREMENTS for s in m.report]
    assert len(sections) == len(set(sections))  # one owner per report section
    assert set(sections) <= set(a.report)  # each names a section report.json has
    assert setup.memory_windows == 5 and setup.burn_in == 10
    # the fields are the measurements' results, no more and no less
    filled = {"verification", "gates", "units", "perturbation", "decomposition",
              "char_classes", "divergence", "reach", "reach_note", "baseline", "lyapunov",
              "fixed_points", "context", "saturation", "causal"}
    assert fields == filled


def test_settings_object_and_keywords_are_one_analysis(tmp_path) -> None:
    net = torch.nn.Sequential(torch.nn.Embedding(3, 4), torch.nn.GRU(4, 5, batch_first=True))
    text = "ab ba " * 20
    s = AnalysisSettings(windows=2, length=24, perturb_pos=4, exponents=2, seed=7)
    by_object = gatelens.Lens(net, vocab=list("ab ")).analyze(text, s).reports["1"]
    by_words = gatelens.Lens(net, vocab=list("ab ")).analyze(
        text, windows=2, length=24, perturb_pos=4, exponents=2, seed=7).reports["1"]
    mixed = gatelens.Lens(net, vocab=list("ab ")).analyze(
        text, dataclasses.replace(s, seed=0), seed=7).reports["1"]
    assert by_object == by_words == mixed
    for seed in (7, 8, 9):  # the seed reached measure: it drew the replacements
        a = gatelens.Lens(net, vocab=list("ab ")).analyze(text, s, seed=seed).analyses["1"]
        assert torch.equal(a.perturbed, perturb_windows(a.windows, 4, 3, seed))


@pytest.mark.parametrize(("options", "message"), [
    ({"windows": 0}, "windows must be an integer >= 1"),
    ({"windows": "some"}, "windows must be an integer >= 1 or \"all\""),
    ({"length": 1}, "length 1: a window needs at least 2 positions"),
    ({"exponents": -1}, "exponents must be an integer >= 0"),
    ({"fixed_points": "yes"}, "fixed_points must be True or False"),
    ({"memory_windows": 1.5}, "memory_windows must be an integer >= 0"),
    ({"seed": -3}, "seed must be an integer >= 0"),
    ({"perturb_pos": -1}, "--perturb-pos -1 leaves no lag"),
    ({"window": 3}, "unknown analysis setting 'window'"),
])
def test_a_bad_setting_is_one_line(options, message) -> None:
    with pytest.raises(GatelensError, match="^" + message.replace("(", r"\(")) as e:
        AnalysisSettings.build(**options)
    assert "\n" not in str(e.value)
    net = torch.nn.GRU(3, 4, batch_first=True)
    with pytest.raises(GatelensError, match=message.split("'")[0][:20]):
        gatelens.Lens(net).analyze(torch.zeros(2, 12, dtype=torch.long), **options)


def test_settings_are_validated_once_and_frozen() -> None:
    s = AnalysisSettings.build(None, windows="all", exponents="all")
    assert s.windows == "all" and s.exponents == "all"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.windows = 3  # type: ignore[misc]
    assert AnalysisSettings.build(s) is s and AnalysisSettings.build() is DEFAULTS
    with pytest.raises(GatelensError, match="settings must be an AnalysisSettings"):
        AnalysisSettings.build({"windows": 2})  # type: ignore[arg-type]
