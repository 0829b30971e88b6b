"""Training the official implementations: ``gatelens train --cell xlstm-slstm ...``.

Each official cell trains a few steps on a small text into a run directory whose
safetensors weights keep the package's own names under ``rnn.``, reopens with
``load_run`` to the same weights and logits, and is analysed through ``analyze RUN``
(verification passed, its step-0 baseline measured). Also: the parameter count is the
built module's own (counted here on a real, not meta, model), ``match_params`` finds the
nearest width, xlstm's zero-initialised R moves in training, resume is exact, sampling
works, and a missing package or an impossible setting is a one-line error.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.families.registry import builtin_recipes
from gatelens.lens.analyze import analyze
from gatelens.lens.run import load_run
from gatelens.training.config import TrainConfig
from gatelens.training.model import matched_hidden, parameter_count
from gatelens.training.runs import read_config
from gatelens.training.train import build, model_config, train

#: the official implementations' --cell names and (import name, PyPI name) of their packages
OFFICIAL_CELLS = tuple(n for n, r in builtin_recipes().items() if r.official)
PACKAGES = {n: builtin_recipes()[n].package for n in OFFICIAL_CELLS}
SIZES = {"xlstm-slstm": {"hidden": 8, "heads": 2, "layers": 2},
         "xlstm-mlstm": {"hidden": 8, "heads": 2, "layers": 2},
         "xlstm-mixed": {"hidden": 8, "heads": 2, "layers": 2},
         "mingru-pytorch": {"hidden": 8, "layers": 2}, "hf-mamba": {"hidden": 8, "layers": 2},
         "hf-mamba2": {"hidden": 8, "layers": 2}, "hf-rwkv": {"hidden": 8, "layers": 2},
         "mambapy": {"hidden": 8, "layers": 2},
         "hf-gated-deltanet": {"hidden": 16, "layers": 2},
         "hf-rglru": {"hidden": 16, "layers": 2}, "rwkv7": {"hidden": 16, "layers": 2}}
SMALL = {"steps": 4, "seq": 16, "batch": 4, "eval_every": 2, "val_windows": 2}
#: where each package's module keeps a tensor of its recurrence (its own name, under rnn.)
OWN_NAME = {"xlstm-slstm": "rnn.blocks.0.xlstm.slstm_cell._recurrent_kernel_",
            "xlstm-mlstm": "rnn.blocks.1.xlstm.mlstm_cell.fgate.weight",
            "xlstm-mixed": "rnn.blocks.1.xlstm.slstm_cell._recurrent_kernel_",
            "mingru-pytorch": "rnn.layers.0.2.to_hidden_and_gate.weight",
            "hf-mamba": "rnn.layers.1.mixer.A_log", "hf-mamba2": "rnn.layers.0.mixer.A_log",
            "hf-rwkv": "rnn.blocks.1.attention.time_decay", "mambapy": "rnn.layers.1.mixer.A_log",
            "hf-gated-deltanet": "rnn.layers.1.A_log",
            "hf-rglru": "rnn.layers.1.temporal_block.rg_lru.recurrent_param",
            "rwkv7": "rnn.blocks.1.att.w0"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    for name, _ in set(PACKAGES.values()):
        importlib.import_module(name)
    d = tmp_path_factory.mktemp("official")
    corpus = d / "c.txt"
    corpus.write_text("the cat sat on the mat; a dog ran far away!\n" * 120, encoding="utf-8")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cell in OFFICIAL_CELLS:
            cfg = TrainConfig(corpus=str(corpus), cell=cell, **SIZES[cell], **SMALL)
            train(cfg, d / cell, progress=False)
            out[cell] = d / cell
    return out


@pytest.mark.parametrize("cell", OFFICIAL_CELLS)
def test_trained_run_reopens_and_is_analysed(runs, cell, tmp_path):
    run = runs[cell]
    cfg = read_config(run)
    assert cfg["model"]["cell"] == cell and cfg["status"] == "done"
    assert cfg["model"]["official"]["package"].startswith(PACKAGES[cell][1] + " ")
    weights = load_file(str(run / "model.safetensors"))
    assert OWN_NAME[cell] in weights
    assert all(k.split(".")[0] in ("rnn", "embed", "head") for k in weights)
    model = load_run(run).model
    assert sorted(model.state_dict()) == sorted(weights)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    ids = torch.randint(0, len(cfg["vocab"]), (2, 10))
    again = load_run(run).model  # a second build from config.json computes the same logits
    with torch.no_grad():
        assert torch.equal(model(ids)[0], again(ids)[0])
        # the one-call-at-a-time path sampling takes: the same logits as the whole
        logits, seen = model(ids[:, 6:], ids[:, :6])
        assert torch.allclose(logits, model(ids)[0][:, 6:], atol=1e-6)
        assert torch.equal(seen, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = analyze(run, windows=2, length=16, perturb_pos=4, out=tmp_path / "a",
                    progress=False, plots=False, exponents=1, memory_windows=1)
    rep = a.report
    assert rep["verification"]["passed"] is True and rep["model"]["step"] == 4
    assert rep["baseline"]["step"] == 0 and (tmp_path / "a" / "report.json").exists()
    assert rep["units"]["n_units"] > 0 and rep["perturbation"]["forget_only"] is not None


@pytest.mark.parametrize("cell", OFFICIAL_CELLS)
def test_parameter_count_is_the_built_modules(cell):
    importlib.import_module(PACKAGES[cell][0])
    cfg = TrainConfig(cell=cell, **SIZES[cell])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real = sum(p.numel() for p in build(cfg, 30).parameters())
        assert parameter_count(model_config(cfg), 30) == real
        target = parameter_count({"cell": "lstm", "hidden": 12, "layers": 1}, 30)
        block = model_config(cfg)
        h = matched_hidden(block, target, 30)
        step = {"xlstm-slstm": 2, "xlstm-mlstm": 2, "xlstm-mixed": 2, "hf-mamba2": 8,
                "hf-gated-deltanet": 16, "hf-rglru": 16, "rwkv7": 16}.get(cell, 1)
        assert h % step == 0
        gaps = [abs(parameter_count({**block, "hidden": k}, 30) - target)
                for k in (h - step, h, h + step) if k > 0]
        assert min(gaps) == abs(parameter_count({**block, "hidden": h}, 30) - target)


def test_xlstm_zero_recurrent_kernel_moves_in_training(runs):
    name = OWN_NAME["xlstm-slstm"]
    step0 = load_run(runs["xlstm-slstm"], 0).model.state_dict()[name]
    assert float(step0.abs().max()) == 0  # xlstm's own init: R = 0
    assert float(load_run(runs["xlstm-slstm"], "final").model.state_dict()[name].abs().max()) > 0


def test_resume_is_exact_and_sampling_reads_the_text(runs, tmp_path):
    corpus = read_config(runs["mambapy"])["train"]["corpus"]
    cfg = TrainConfig(corpus=corpus, cell="mambapy", **SIZES["mambapy"], **SMALL)
    train(cfg, tmp_path / "r", progress=False, stop_at=3)
    train(None, tmp_path / "r", resume=True, progress=False)
    want = load_file(str(runs["mambapy"] / "checkpoints" / "step-000004.safetensors"))
    got = load_file(str(tmp_path / "r" / "checkpoints" / "step-000004.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert main(["sample", str(runs["mambapy"]), "--length", "12", "--prime", "the"]) == 0


def test_cli_trains_an_official_cell(runs, tmp_path, capsys):
    corpus = read_config(runs["mingru-pytorch"])["train"]["corpus"]
    argv = ["train", "--cell", "mingru-lm", "--corpus", corpus, "--hidden", "8", "--steps",
            "2", "--batch", "2", "--seq", "16", "--eval-every", "2", "--val-windows", "2",
            "--quiet", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    assert read_config(tmp_path / "r")["model"]["official"]["expansion"] == 1.5
    # the earlier --cell name is an alias: the run records the family's one name
    assert read_config(tmp_path / "r")["model"]["cell"] == "mingru-pytorch"


@pytest.mark.parametrize("cell", ["hf-rglru", "rwkv7"])  # fed our embedding; ids
def test_verify_reads_an_official_run(runs, cell, capsys):
    # `gatelens verify RUN` feeds the module what the LM feeds it (OfficialLM.encode)
    assert main(["verify", str(runs[cell]), "--windows", "2", "--length", "16"]) == 0
    out = capsys.readouterr().out
    assert "layer1: one-step" in out and out.rstrip().endswith("passed (tolerance 1e-05)")


@pytest.mark.parametrize("settings, says", [
    ({"cell": "hf-rwkv", "layers": 1}, "--layers 2 or more"),
    ({"cell": "hf-mamba2", "hidden": 12}, "multiple of 8"),
    ({"cell": "hf-mamba", "heads": 2, "hidden": 8}, "--heads applies to"),
    ({"cell": "mambapy", "embed": 4}, "--embed does not apply"),
    ({"cell": "xlstm-slstm", "forget_bias": 1.0}, "--forget-bias does not apply"),
    ({"cell": "xlstm-slstm", "heads": 3, "hidden": 8}, "multiple of 3"),
])
def test_impossible_settings_are_one_line_errors(settings, says):
    with pytest.raises(GatelensError, match=says):
        TrainConfig(**settings).validate()


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(GatelensError, match=r"needs the transformers package: pip install "
                                            r"'gatelens\[modern\]'"):
        build(TrainConfig(cell="hf-mamba", hidden=8), 10)
