"""Half-precision weights: verified at their own precision, and the words agree with report.json.

float16 and bfloat16 round every step at their own scale (float16's eps 9.8e-4, bfloat16's
7.8e-3), so the one-step error sits far above float32's 1e-5 while the read-out is right;
``tolerance_for`` gives 8 × eps (docs/methods.md, "Verification"). Whether the model is
called contracting or chaotic in the words is report.json's divergence regime (issue 20:
float16 weights once printed "chaotic" beside λ = −0.40).
"""

from __future__ import annotations

import pytest
import torch

import gatelens
from gatelens.readout.verify import VERIFY_TOL, tolerance_for

CHARS = list("abcdefgh ")


class CharModel(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(len(CHARS), 32)
        self.lstm = torch.nn.LSTM(32, 64, batch_first=True)  # ×16: chaotic (λ ≈ +0.11–0.14)
        self.head = torch.nn.Linear(64, len(CHARS))
        with torch.no_grad():
            for p in self.lstm.parameters():
                p.mul_(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def text() -> str:
    g = torch.Generator().manual_seed(1)
    return "".join(CHARS[i] for i in torch.randint(0, len(CHARS), (2000,), generator=g).tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_half_precision_verdicts(dtype: torch.dtype, scale: float) -> None:
    torch.manual_seed(0)
    model = CharModel(scale).to(dtype)
    result = gatelens.Lens(model, vocab=CHARS).analyze(text(), windows=4, length=64,
                                                      perturb_pos=8, exponents=4)
    rep, a = result.reports["lstm"], result.analyses["lstm"]
    ver = rep["verification"]
    assert ver["tolerance"] == tolerance_for(dtype) == 8 * torch.finfo(dtype).eps
    assert ver["passed"], ver
    assert ver["one_step_max_abs_diff_h"] > VERIFY_TOL  # float32's rule would call it wrong
    regime = rep["divergence"]["regime"]
    assert regime == ("contracting" if scale == 1.0 else "chaotic")
    words = a.verification.explain()
    assert f"({regime} on this text)" in words or (regime == "chaotic" and "chaotic" in words)
    other = "chaotic" if regime == "contracting" else "contracting"
    assert other not in words, words


def test_a_package_whose_own_forward_fails_at_half_precision_is_told_to_load_float32():
    """transformers' Mamba with use_mambapy (what ``--cell hf-mamba`` trains) runs its scan
    in float32 on the CPU, so in bfloat16 its own forward raises: the line says so, not that
    the model takes other inputs."""
    from gatelens.errors import GatelensError
    from gatelens.training.model import OfficialLM

    torch.manual_seed(0)
    model = OfficialLM(7, "hf-mamba", 16, 2).eval().to(torch.bfloat16)
    ids = torch.randint(0, 7, (2, 12))
    with pytest.raises(GatelensError, match=r"OfficialLM\(ids\) failed .*dtype.*; its "
                       r"weights are bfloat16 and its own forward mixes them with float32 "
                       r"here; load it in float32 \(model.float\(\)\)$"):
        gatelens.Lens(model, vocab=7).analyze(ids, perturb_pos=3)
    model.float()
    assert gatelens.Lens(model, vocab=7).analyze(ids, perturb_pos=3, exponents=1).reports[
        "rnn"]["verification"]["passed"]


def test_a_trained_mamba2_in_bfloat16_is_read_at_its_own_precision():
    """transformers' Mamba-2 norm returns float32 whatever the weights; gatelens's LM around
    it (``--cell hf-mamba2``) hands its head the head's own dtype, as the package's LM head
    does, so the bfloat16 model runs and is verified at bfloat16's tolerance."""
    from gatelens.training.model import OfficialLM

    torch.manual_seed(0)
    model = OfficialLM(7, "hf-mamba2", 32, 1).eval().to(torch.bfloat16)
    ids = torch.randint(0, 7, (2, 12))
    with torch.no_grad():
        assert model(ids)[0].dtype == torch.bfloat16
    ver = gatelens.Lens(model, vocab=7).analyze(ids, perturb_pos=3, exponents=1).reports[
        "rnn"]["verification"]
    assert ver["passed"] and ver["tolerance"] == tolerance_for(torch.bfloat16)
