"""report.json stays readable at size: above 4096 units a per-unit array is summarised
(quantiles, a histogram) and written whole to arrays.safetensors beside it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import gatelens
from gatelens.report.json_report import PER_UNIT_CAP

transformers = pytest.importorskip("transformers")


def test_per_unit_arrays_above_the_cap_go_to_a_side_file(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=9, hidden_size=32, state_size=64,
                                   num_hidden_layers=2, expand=2, conv_kernel=3,
                                   time_step_rank=4, use_cache=False)
    model = transformers.MambaForCausalLM(cfg).eval()
    ids = torch.randint(0, 9, (2, 10), generator=torch.Generator().manual_seed(1))
    res = gatelens.Lens(model).analyze(ids, perturb_pos=3, exponents=0, memory_windows=0,
                                       out=tmp_path / "a")
    (path, a), = res.analyses.items()
    n = a.units.n_units
    assert n == 2 * 64 * 64 > PER_UNIT_CAP
    d = tmp_path / "a" / path
    rep = json.loads((d / "report.json").read_text())
    units = rep["units"]
    assert units["per_unit"] is None and units["n_units"] == n
    summary = units["per_unit_summary"]
    assert summary["file"] == "arrays.safetensors" and summary["key"] == "units.per_unit"
    whole = load_file(str(d / "arrays.safetensors"))["units.per_unit"]
    np.testing.assert_array_equal(whole, a.units.forget_means.astype(np.float32))
    means = a.units.forget_means
    assert summary["quantiles"]["p50"] == pytest.approx(float(np.median(means)), rel=1e-12)
    assert summary["quantiles"]["max"] == pytest.approx(float(means.max()), rel=1e-12)
    assert sum(summary["histogram"]["counts"]) == n
    assert (d / "plots" / "units_forget_mean.png").is_file()  # drawn from the whole array
    assert (d / "report.json").stat().st_size < 200_000


def test_small_models_keep_their_arrays_inline(tmp_path) -> None:
    net = torch.nn.Sequential(torch.nn.Embedding(3, 4), torch.nn.LSTM(4, 5, batch_first=True))
    res = gatelens.Lens(net, vocab=list("ab ")).analyze("ab ba " * 20, windows=2, length=24,
                                                        perturb_pos=4, out=tmp_path / "s")
    rep = res.reports["1"]
    assert len(rep["units"]["per_unit"]) == 5 and "per_unit_summary" not in rep["units"]
    assert not (tmp_path / "s" / "1" / "arrays.safetensors").exists()
