"""`gatelens verify RUN`: per-layer differences printed; exit 1 when the read-out is off."""

from __future__ import annotations

import copy
import importlib

import pytest

import gatelens
from gatelens.cli import main
from gatelens.families.torch_rnn import max_diff
from gatelens.training.config import TrainConfig
from gatelens.training.train import train

verify_mod = importlib.import_module("gatelens.readout.verify")  # the module, not the function


@pytest.fixture
def run2(tiny_text, tmp_path):
    cfg = TrainConfig(corpus=str(tiny_text), hidden=12, layers=2, steps=3, batch=4, seq=16,
                      eval_every=3, val_windows=2, device="cpu")
    train(cfg, tmp_path / "run", progress=False)
    return tmp_path / "run"


def test_verify_passes_and_reports_each_layer(capsys, run2):
    assert main(["verify", str(run2), "--windows", "4", "--length", "40"]) == 0
    out = capsys.readouterr().out
    assert "layer0: one-step max |h_hand - h_torch|" in out and "layer1:" in out
    assert "passed" in out and "Free-running divergence" in out
    for line in out.splitlines():
        if line.strip().startswith("layer"):
            assert float(line.split("|h_hand - h_torch|")[1].split()[0]) <= 1e-5


def test_verify_fails_with_exit_1_above_tolerance(capsys, run2):
    # float32 read-out differs from PyTorch by ~1e-7: a tolerance of 1e-12 must fail
    assert main(["verify", str(run2), "--windows", "2", "--length", "20", "--tol", "1e-12"]) == 1
    captured = capsys.readouterr()
    assert "check failed" in captured.err and "Traceback" not in captured.err


def test_verify_catches_a_trace_of_other_weights():
    """A trace of a module whose layer-1 weights differ by 1e-3 fails on layer 1 only."""
    import torch

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(3, 8, num_layers=2, batch_first=True)
    x = torch.randn(2, 10, 3)
    other = copy.deepcopy(lstm)
    with torch.no_grad():
        other.weight_hh_l1.add_(1e-3)
    res = verify_mod.verify(lstm, x, trace=gatelens.trace(other, x))
    assert not res.passed and res.passes_one_step
    assert res.trace_max_abs_diff_h > 1e-5


def test_verify_bad_input(capsys, run2, tmp_path):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert main(["verify", str(run2), "--checkpoint", "7"]) == 2
    err = capsys.readouterr().err
    assert "no such run directory" in err and "steps available: 0, 3" in err


def test_c_is_judged_relative_to_its_size():
    """|c| of 20 carries float32 rounding of ~2e-6 a step: judged by |Δc| / max(1, |c|)."""
    import torch

    big = torch.tensor([[20.0, 0.5]])
    assert max_diff(big + torch.tensor([[1.5e-5, 0.0]]), big) > 1e-5
    assert max_diff(big + torch.tensor([[1.5e-5, 0.0]]), big, scaled=True) < 1e-6
    assert max_diff(big + torch.tensor([[0.0, 2e-5]]), big, scaled=True) > 1e-5
    ok = verify_mod.VerifyResult("lstm", [], 1e-7, 1.4e-5, 7e-7, 1e-7)
    bad = verify_mod.VerifyResult("lstm", [], 1e-7, 2e-5, 2e-5, 1e-7)
    assert ok.passed and not bad.passed
