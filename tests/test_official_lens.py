"""``Lens`` end to end on each official implementation, inside its own language model.

A small random model of each (xlstm's sLSTM and mLSTM stacks in ``xLSTMLMModel``,
mingru-pytorch's ``minLM``, HF ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` /
``RwkvForCausalLM``, mambapy's ``Mamba`` between an embedding and a head) is measured on
a small text: report.json passes its schema, verification passes, the keep gate, unit
half-lives and perturbation figures are finite, and the perturbation split adds up. The
forget path is recomputed here by hand from the two traces and the family's
``state_units`` (which unit's keep factor scales each coordinate of s), so a read-out
that paired the keep gate with the wrong state coordinates would fail.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path

import jsonschema
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
import gatelens
from gatelens.analysis.common import pooled
from gatelens.report.json_report import check_report, schema
from official_models import _quiet, _spread

V, D = 11, 8
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
WINDOWS, LENGTH, P = 2, 32, 8


def _xlstm(kind: str) -> torch.nn.Module:
    xlstm = importlib.import_module("xlstm")
    blocks = {"slstm_block": xlstm.sLSTMBlockConfig(slstm=xlstm.sLSTMLayerConfig(
        backend="vanilla", num_heads=2)), "slstm_at": "all"} if kind == "slstm" else {
        "mlstm_block": xlstm.mLSTMBlockConfig(mlstm=xlstm.mLSTMLayerConfig(num_heads=2)),
        "slstm_at": []}
    lm = xlstm.xLSTMLMModel(xlstm.xLSTMLMModelConfig(
        vocab_size=V, context_length=LENGTH, num_blocks=2, embedding_dim=D, **blocks))
    _spread(lm, 0.2)  # xlstm starts R and mLSTM's gate weights at zero
    return lm


def _hf(kind: str) -> torch.nn.Module:
    transformers = importlib.import_module("transformers")
    _quiet()
    if kind == "mamba":
        return transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=V, hidden_size=D, state_size=4, num_hidden_layers=2))
    if kind == "mamba2":
        return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
            vocab_size=V, hidden_size=D, state_size=4, num_heads=2, head_dim=8, expand=2,
            n_groups=1, num_hidden_layers=2, chunk_size=16))
    # transformers 5.23 cannot build one RWKV layer (ZeroDivisionError in _init_weights)
    return transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=2, context_length=LENGTH,
        attention_hidden_size=D, intermediate_size=2 * D))


def _minlm() -> torch.nn.Module:
    importlib.import_module("minGRU_pytorch")
    from minGRU_pytorch.minLM import minLM

    return minLM(num_tokens=V, dim=D, depth=2)


def _mambapy() -> torch.nn.Module:
    importlib.import_module("mambapy")
    from mambapy.mamba import Mamba, MambaConfig

    # mambapy 1.2.0's own MambaLM imports mamba_ssm (CUDA only): wrapped by hand
    return torch.nn.Sequential(torch.nn.Embedding(V, D), Mamba(MambaConfig(
        d_model=D, n_layers=2, d_state=4, d_conv=3)), torch.nn.Linear(D, V))


MODELS = {
    "xlstm-slstm": (lambda: _xlstm("slstm"), "xlstm-slstm"),
    "xlstm-mlstm": (lambda: _xlstm("mlstm"), "xlstm-mlstm"),
    "mingru-lm": (_minlm, "mingru-pytorch"),
    "hf-mamba": (lambda: _hf("mamba"), "hf-mamba"),
    "hf-mamba2": (lambda: _hf("mamba2"), "hf-mamba2"),
    "hf-rwkv": (lambda: _hf("rwkv"), "hf-rwkv"),
    "mambapy": (_mambapy, "mambapy"),
}


def _forget_by_hand(a, fam) -> list[float]:
    """a(k) = mean over windows of ‖(∏ keep) ⊙ δs_p‖ / ‖δs_p‖, each coordinate of s scaled
    by its own unit's keep (``state_units``), from the two kept traces."""
    tr, tr2 = a.trace, a.trace_perturbed
    ds = (pooled(tr2, tr.state_name) - pooled(tr, tr.state_name)).double()  # (B, T, S)
    keep = torch.cat([tr[f"layer{k}.{tr.keep_gate}"][..., fam.state_units(k)]
                      for k in range(fam.num_layers)], dim=-1).double()  # (B, T, S)
    base = ds[:, P]
    rolled, out = base.clone(), {}
    for k in range(1, LENGTH - P):
        rolled = keep[:, P + k] * rolled
        out[k] = (rolled.norm(dim=-1) / base.norm(dim=-1)).mean().item()
    return [out[k] for k in a.perturbation.lags]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_lens_measures_the_official_model(kind):
    build, family = MODELS[kind]
    torch.manual_seed(0)
    model = build().eval()
    lens = gatelens.Lens(model, vocab=VOCAB)
    ((path, fam),) = lens.families.items()
    assert fam.name == family
    ids, chars, _ = lens.windows(TEXT, WINDOWS, LENGTH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = lens.measure(path, ids, chars, perturb_pos=P, exponents=1)
    rep = a.report
    check_report(rep)
    jsonschema.validate(rep, schema())
    assert rep["model"]["family"] == family and rep["verification"]["passed"] is True
    assert rep["units"]["gate"] == fam.spec.keep_gate
    assert rep["units"]["n_units"] == fam.num_layers * fam.hidden_size
    keep = rep["gates"][fam.spec.keep_gate]
    assert all(0 <= keep[q] <= 1 for q in ("p5", "p50", "p95"))
    assert all(math.isfinite(v) for v in rep["units"]["half_life"].values())
    pert = rep["perturbation"]
    assert pert["n"] == WINDOWS and pert["lags"] == [1, 2, 4, 8, 16]
    assert all(v is not None and math.isfinite(v) for v in pert["measured"] + pert["forget_only"])
    assert pert["half_life_forget_only"] is not None
    # the split: measured = forget path + return path, coordinate by coordinate
    dec = a.decomposition
    scale = float(dec["measured"].abs().max())
    assert scale > 0
    assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
        < 1e-5 * max(scale, 1.0)  # float32 rounding of the traced values
    assert rep["decomposition"]["max_abs_residual"] < 1e-5 * max(scale, 1.0)
    assert pert["forget_only"] == pytest.approx(_forget_by_hand(a, fam), rel=1e-5, abs=1e-12)
    # two layers: the upper layer's input differs at every lag, so a return path exists
    assert max(rep["decomposition"]["return_path"]) > 1e-6
    assert rep["output_reach"] is not None and len(rep["output_reach"]["kl"]) >= 1
    # the return path cut (every letter but the state and the output, and the write, at
    # their clean values from p + 1 on) is the forget-only curve; the state s is ablated
    cut, ablated = rep["causal"]["return_cut"], rep["causal"]["state_ablation"]
    assert rep["causal"]["note"] is None and "entry" in cut["patched"]
    assert cut["max_abs_diff"] < 1e-5 and ablated["ablated"] == [fam.spec.state]


def test_lens_writes_the_report_of_an_official_model(tmp_path):
    import json

    torch.manual_seed(0)
    model = _hf("mamba").eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = gatelens.Lens(model, vocab=VOCAB).analyze(
            TEXT, windows=WINDOWS, length=LENGTH, perturb_pos=P, out=tmp_path, exponents=1)
    (path,) = result.reports
    written = json.loads((tmp_path / path / "report.json").read_text())
    jsonschema.validate(written, schema())
    assert written["verification"]["passed"] is True
    assert (tmp_path / path / "report.html").exists() and (tmp_path / "index.html").exists()
