"""The modern-official study preset: its sizes are the ones its comment gives, matched to the
325-unit LSTM's parameter count (V = 84) where it says so, smaller where it says the
official model's step time would not fit a trial."""

from __future__ import annotations

import importlib
import warnings

from gatelens.studies import spec as study_spec
from gatelens.studies.merge import model_size
from gatelens.studies.spec import load_preset
from gatelens.training.config import TrainConfig
from gatelens.training.model import matched_hidden
from gatelens.training.train import model_config

LSTM = 561684
#: cell -> (hidden, layers, matched to the LSTM?)
SIZES = {"lstm": (325, 1, True), "xlstm-slstm": (192, 1, False), "xlstm-mlstm": (96, 2, False),
         "mingru-lm": (146, 2, True), "hf-mamba": (96, 2, False), "hf-rwkv": (143, 2, True)}


def test_modern_official_preset_sizes(monkeypatch):
    for name in ("xlstm", "minGRU_pytorch", "transformers"):
        importlib.import_module(name)
    monkeypatch.setitem(study_spec._VOCAB, "shakespeare", 84)
    spec = load_preset("modern-official")
    assert len(spec.trials) == 18 and all(t.train["steps"] == 800 for t in spec.trials)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in spec.trials[::3]:
            cell = t.condition["cell"]
            hidden, layers, matched = SIZES[cell]
            size = model_size(t.train, 84)
            assert (size["hidden"], size["layers"]) == (hidden, layers), cell
            if matched:
                assert matched_hidden(model_config(TrainConfig.from_dict(t.train)), LSTM,
                                      84) == hidden
                assert abs(size["parameters"] / LSTM - 1) < 0.07, (cell, size)
            else:  # the preset's comment: smaller than the LSTM, to fit a trial's time
                assert size["parameters"] < 0.5 * LSTM, (cell, size)
