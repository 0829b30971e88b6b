"""Non-finite numbers on the training side: weights holding NaN/Inf are refused when loaded
(one line naming the tensor; ``check_finite=False`` to inspect them), training that goes
non-finite stops (exit 1) keeping its last finite checkpoint, and non-finite settings are
usage errors before anything is written."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.lens.foreign_io import read_tensors
from gatelens.training.config import TrainConfig
from gatelens.training.runs import load_run, read_config, read_weights
from gatelens.training.sample import sample
from gatelens.training.train import TrainingDiverged, train

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import SMALL, one_line  # noqa: E402


@pytest.fixture
def run(tiny_text, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(out)]) == 0
    return out


def poison(path, name: str, value: float = float("nan")) -> None:
    t = load_file(str(path))
    t[name][0, 0] = value
    save_file(t, str(path), metadata={"step": "4"})


def test_weights_with_nan_are_refused_naming_the_tensor(capsys, run):
    poison(run / "model.safetensors", "rnn.weight_hh_l0")
    says = "model.safetensors: tensor rnn.weight_hh_l0 holds NaN or Inf (1 of"
    assert says in one_line(capsys, ["sample", run])
    assert says in one_line(capsys, ["verify", run])
    with pytest.raises(GatelensError, match="rnn.weight_hh_l0 holds NaN"):
        read_weights(run / "model.safetensors")
    with pytest.raises(GatelensError, match="rnn.weight_hh_l0 holds NaN"):
        read_tensors(run / "model.safetensors")
    loaded = load_run(run, check_finite=False)  # to inspect what went wrong
    assert torch.isnan(loaded.model.rnn.weight_hh_l0[0, 0])
    assert torch.isnan(read_tensors(run / "model.safetensors", check_finite=False)[
        "rnn.weight_hh_l0"][0, 0])
    main(["sample", str(run), "--checkpoint", "final", "--length", "3"])  # others still load
    assert capsys.readouterr().err == ""


def test_sampling_overflowing_logits_is_one_line_not_a_traceback(run):
    loaded = load_run(run)
    with torch.no_grad():  # finite weights: h near +1 everywhere, a head that overflows
        for name, p in loaded.model.rnn.named_parameters():
            p.fill_(50.0) if "bias" in name else p.zero_()
        loaded.model.head.weight.fill_(3e38)
    with pytest.raises(GatelensError, match="probabilities are not finite"):
        sample(loaded, length=5)


@pytest.mark.parametrize("at, says", [(6, "the training loss is nan at step 7"),
                                       (8, "the validation loss is nan at step 8")])
def test_training_that_goes_non_finite_keeps_its_last_finite_checkpoint(
        tiny_text, tmp_path, monkeypatch, at, says):
    import gatelens.training.train as tr

    cfg = TrainConfig(corpus=str(tiny_text), hidden=8, steps=10, batch=4, seq=16, eval_every=4,
                      val_windows=2, device="cpu")
    out, models = tmp_path / "run", []
    real_build = tr.build
    monkeypatch.setattr(tr, "build", lambda c, v: models.append(real_build(c, v)) or models[-1])

    def blow_up(step):  # as an overflow in the optimiser's step would
        if step == at:
            with torch.no_grad():
                models[0].rnn.weight_hh_l0.fill_(float("inf"))
    with pytest.raises(TrainingDiverged, match=f"diverged: {says}.*last finite checkpoint, "
                                               "step 4"):
        train(cfg, out, progress=False, on_step=blow_up)
    saved = read_config(out)
    assert saved["status"] == "diverged" and saved["steps_done"] == 4 and says in saved[
        "diverged"]
    for f in ("model.safetensors", "resume.safetensors", "checkpoints/step-000004.safetensors"):
        read_weights(out / f)  # all finite
    assert not (out / "checkpoints" / "step-000008.safetensors").exists()
    assert load_run(out).step <= 4
    rows = (out / "history.csv").read_text().splitlines()[1:]
    assert max(int(r.split(",")[0]) for r in rows) == 4


def test_a_learning_rate_that_overflows_stops_with_exit_1(capsys, tiny_text, tmp_path):
    out = tmp_path / "run"
    line = one_line(capsys, ["train", "--corpus", tiny_text, *SMALL, "--steps", "20",
                             "--lr", "1e37", "--out", out], code=1)
    assert "training diverged: the training loss is inf" in line and "--lr 1e+37" in line
    assert read_config(out)["status"] == "diverged"
    read_weights(out / "resume.safetensors")  # the last saved state is finite


@pytest.mark.parametrize("flag, value", [
    ("--lr", "nan"), ("--lr", "inf"), ("--lr", "-inf"), ("--clip", "nan"), ("--clip", "inf"),
    ("--forget-bias", "nan"), ("--forget-bias", "inf"), ("--chrono", "inf"),
    ("--chrono", "nan"), ("--chrono", "1.5"), ("--seed", str(2**70)), ("--seed", str(-2**63 - 1)),
])
def test_non_finite_or_out_of_range_settings_are_usage_errors(capsys, tiny_text, tmp_path, flag,
                                                              value):
    out = tmp_path / "run"
    line = one_line(capsys, ["train", "--corpus", tiny_text, *SMALL, flag, value, "--out", out])
    assert flag in line
    assert not out.exists()


def test_config_checks_non_finite_numbers_too():
    for bad in ({"lr": float("inf")}, {"clip": float("nan")}, {"forget_bias": float("-inf")},
                {"chrono": float("inf")}, {"seed": 2**64}, {"lr": True}):
        with pytest.raises(GatelensError):
            TrainConfig(**bad).validate()
    TrainConfig(seed=-3).validate()
    TrainConfig(seed=2**64 - 1).validate()


def test_a_left_stub_does_not_block_a_retry(capsys, tiny_text, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".gatelens.lock").write_text(json.dumps({"pid": 999999999, "host": "gone"}))
    (out / ".config.json.abc.tmp").write_text("{half")
    assert main(["train", "--corpus", str(tiny_text), *SMALL, "--out", str(out)]) == 0
    assert "taking over the lock of pid 999999999 on host gone" in capsys.readouterr().err
    assert not (out / ".config.json.abc.tmp").exists()


def test_a_nan_figure_is_never_dropped_whatever_its_place() -> None:
    """Python's max keeps or drops a NaN by its place (max(0.0, nan) is 0.0): every figure a
    verdict is made of keeps it, so a NaN row never passes."""
    import math

    from gatelens.families.base import LayerDiff
    from gatelens.families.records import nan_max, worst_of
    from gatelens.readout.verify import VerifyResult
    from gatelens.readout.verify_figures import maxes

    nan = math.nan
    assert max(0.0, nan) == 0.0  # the trap
    assert math.isnan(nan_max(0.0, nan)) and math.isnan(nan_max(nan, 0.0))
    assert [math.isnan(v) for v in worst_of([(1e-7, 1e-7), (nan, 2e-7)])] == [True, False]
    ok, bad = LayerDiff(0, False, 1e-7, None), LayerDiff(1, False, nan, None)
    for rows in ([ok, bad], [bad, ok]):
        worst = maxes(rows, "max_abs_diff_h")
        assert math.isnan(worst)
        assert not VerifyResult("gru", rows, worst, None, None, 1e-7).passed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_scaled_difference_in_blocks_of_units_is_the_wholes(dtype, monkeypatch):
    """``scaled_diff`` takes a block of units at a time (``DIFF_BYTES``): the same figures as
    the whole tensor's, written out here, a NaN in any block kept, and ``ref`` untouched."""
    from gatelens.families import records

    gen = torch.Generator().manual_seed(0)
    ref = (torch.randn(2, 7, 10, generator=gen) * torch.logspace(-2, 2, 10)).to(dtype)
    got = ref + 1e-4 * torch.randn(2, 7, 10, generator=gen).to(dtype)
    before = ref.clone()
    diff = (got.double() - ref.double()).abs()
    want = (float(diff.max()),
            float((diff / ref.double().abs().amax(1, keepdim=True).clamp(min=1.0)).max()))
    monkeypatch.setattr(records, "DIFF_BYTES", 3 * 2 * 7 * dtype.itemsize)  # 3 units a block
    got_pair = records.scaled_diff(got, ref)
    assert got_pair == pytest.approx(want, rel=1e-6) and torch.equal(ref, before)
    got[1, 3, 8] = float("nan")  # in the last block
    assert [math.isnan(v) for v in records.scaled_diff(got, ref)] == [True, True]
