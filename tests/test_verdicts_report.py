"""report.md's reading of a FAILED verification never calls the divergence rounding,
chaos or "not an error"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gatelens
from gatelens.readout.verify import VerifyResult
from gatelens.report.markdown import render_markdown

pytestmark = pytest.mark.usefixtures("one_thread")

EXCUSES = ("rounding at", "not chaos", "not an error", "model's property", "chaotic on")


class Doubling(nn.LSTM):
    """An nn.LSTM subclass whose forward doubles x: not the cell gatelens reads."""

    def forward(self, x, hx=None):  # type: ignore[override]
        return super().forward(2 * x, hx)


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 5)
        self.lstm = Doubling(5, 8, batch_first=True)
        self.head = nn.Linear(8, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def test_report_md_of_the_doubling_subclass_reads_failed_not_rounding() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 6, (2, 30))
    result = gatelens.Lens(LM(), vocab=6).analyze(ids, perturb_pos=4, exponents=0,
                                                  fixed_points=False)
    a = result.analyses["lstm"]
    v = a.verification
    assert not v.passed and v.free_running_max_abs_diff_h > 0.1
    reading = next(line for line in render_markdown(a.report).splitlines()
                   if line.startswith("Reading: one-step error"))
    assert "(FAILED)" in reading and "no evidence of rounding or chaos" in reading
    assert not any(e in reading for e in EXCUSES), reading


@pytest.mark.parametrize("regime", [None, "contracting", "chaotic"])
def test_a_failed_one_step_is_never_excused(regime: str | None) -> None:
    r = VerifyResult("lstm", [], 0.24, 0.3, 0.36, 0.39, regime=regime,
                     meta={"dtype": "torch.float32"})
    text = r.explain()
    assert not r.passed and "(FAILED)" in text
    assert not any(e in text for e in EXCUSES), text


def test_a_passed_one_step_still_reads_its_divergence() -> None:
    contracting = VerifyResult("lstm", [], 1e-7, 1e-7, 1e-7, 3e-5, regime="contracting",
                               meta={"dtype": "torch.float32"}).explain()
    assert "rounding at torch.float32 precision" in contracting
    chaotic = VerifyResult("lstm", [], 1e-7, 1e-7, 1e-7, 0.4, regime="chaotic").explain()
    assert "the model is chaotic on this text" in chaotic


def test_a_failed_modern_step_is_not_called_rounding() -> None:
    r = VerifyResult("mingru", [], 0.3, None, None, 0.5, one_step_max_scaled_diff_h=0.2)
    assert "(FAILED)" in r.explain() and "not an error" not in r.explain()
    ok = VerifyResult("mingru", [], 7e-4, None, None, 2e-3, one_step_max_scaled_diff_h=3e-7)
    assert "rounding carried up" in ok.explain()


def test_a_trace_that_fails_on_c_says_c() -> None:
    r = VerifyResult("lstm", [], 1e-7, 1e-7, 1e-7, 1e-7, trace_max_abs_diff_h=0.0,
                     trace_max_scaled_diff_c=0.36)
    assert "by h 0, c 0.36 scaled by max(1, |c|): it is not" in r.explain()
