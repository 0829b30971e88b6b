"""A local Hugging Face checkpoint with several recurrent modules: ``gatelens verify --model
DIR`` verifies each on token windows without an analysis (loaders/hf_verify.py), and
``gatelens analyze --model DIR`` measures each, or those ``--modules``/``--layers`` pick
(loaders/hf_analyze.py).

The checkpoint is a small random Qwen3-Next hybrid (two Gated DeltaNet layers around a
full-attention one) saved with ``save_pretrained`` beside a tokenizer trained in the test;
nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.families.hf_gated_deltanet import HFGatedDeltaNetFamily
from gatelens.loaders.hf_verify import verify_modules
from gatelens.readout.verify import verify

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (importlib mode)
from cli_helpers import one_line  # noqa: E402
from test_hf_dir import TEXT, trained_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PATHS = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> tuple[Path, Path]:
    """(the checkpoint directory, a text file)."""
    d = tmp_path_factory.mktemp("hf") / "qwen3next"
    tok = trained_tokenizer()
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=0,
        layer_types=["linear_attention", "full_attention", "linear_attention"]))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    text = d.parent / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return d, text


def test_every_recurrent_module_is_verified_on_token_windows(hybrid, capsys):
    d, text = hybrid
    assert main(["verify", "--model", str(d), "--text", str(text), "--length", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{d}, 2 windows x 16 tokens of {text}:")
    for path in PATHS:
        assert f"  {path} (hf-gated-deltanet):\n    layer0: one-step" in out
    assert out.count("(passed)") == 2 and out.rstrip().endswith("passed (tolerance 1e-05)")
    # --modules picks some of them
    assert main(["verify", "--model", str(d), "--text", str(text), "--length", "16",
                 "--modules", "-1"]) == 0
    out = capsys.readouterr().out
    assert PATHS[1] in out and PATHS[0] not in out


def test_the_figures_are_verify_s_on_what_each_module_received():
    """transformers' MambaModel reads the ids themselves: ``verify`` of the backbone on the
    ids is the same verdict, figure for figure."""
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=12, hidden_size=8, num_hidden_layers=2, state_size=4, use_cache=False))
    ids = torch.randint(0, 12, (2, 9), generator=torch.Generator().manual_seed(1))
    (path, res), = verify_modules(model, ids)
    alone = verify(model.backbone, ids)
    assert path == "backbone" and res.passed and len(res.layers) == 2
    assert res.to_dict() == alone.to_dict()


def test_one_forward_catches_every_module_s_input(hybrid):
    """``Lens.capture`` reads what each recurrent module received from one forward of the
    whole model, the same tensors ``runner(path)`` catches from a forward of its own; and
    ``verify_modules`` runs the model once for all its modules (a stack of L recurrent
    layers is one forward, not L), giving each the verdict ``verify`` gives it alone."""
    from gatelens import Lens

    d, _ = hybrid
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(2))
    lens = Lens(model, vocab=model.config.vocab_size)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    seen = lens.capture(ids)
    assert list(seen) == PATHS and len(forwards) == 1
    for path in PATHS:
        alone = lens.runner(path)(ids)
        assert torch.equal(seen[path].inputs, alone.inputs)
        assert torch.equal(seen[path].logits, alone.logits)
    forwards.clear()
    results = dict(verify_modules(model, ids))
    assert len(forwards) == 1 and list(results) == PATHS
    for path in PATHS:
        alone = verify(lens.families[path].module, seen[path].inputs, seen[path].state)
        assert results[path].to_dict() == alone.to_dict()
    with pytest.raises(GatelensError, match="'model.layers.1.linear_attn' is not a recurrent"):
        lens.capture(ids, ["model.layers.1.linear_attn"])


def test_a_wrong_read_out_in_one_module_exits_1_naming_it(hybrid, capsys, monkeypatch):
    """The output norm's weight off by 10 % in the hand cell of the second Gated DeltaNet
    layer only: that module fails, the first still passes, and the exit code is 1. (This
    small random model's outputs are ~2e-3, and the rule judges them absolutely below 1: a
    10 % error is 2.2e-4 there.)"""
    d, text = hybrid
    real = HFGatedDeltaNetFamily.float64

    def wrong(self):
        m = real(self)
        if self.module.layer_idx == 2:
            with torch.no_grad():
                m.norm.weight.copy_(self.module.norm.weight.double() * 1.1)
        return m

    monkeypatch.setattr(HFGatedDeltaNetFamily, "float64", wrong)
    code = main(["verify", "--model", str(d), "--text", str(text), "--length", "16"])
    out, err = capsys.readouterr()
    assert code == 1
    first, second = out.split(PATHS[1])
    assert "(passed)" in first and "(FAILED" in second
    assert err.strip().endswith(f"more than the tolerance in {PATHS[1]}")


def test_bad_verify_input_is_one_line(hybrid, tmp_path, capsys):
    d, text = hybrid
    base = ["verify", "--model", d, "--text", text, "--length", "16"]
    assert one_line(capsys, [*base, "--modules", "7"]).endswith(
        "--modules: 7 is not one of the 2 recurrent modules (0..1, or -2..-1)")
    assert one_line(capsys, [*base, "--checkpoint", "3"]).endswith(
        "verify: --checkpoint applies to a run directory, not to --model DIR; leave it out")
    assert one_line(capsys, ["verify", "--model", d]).endswith(
        f"{d}: --model needs --text FILE (the text to read, as its tokens)")
    assert one_line(capsys, [*base, "--windows", "99"]).endswith(
        "tokens, too few for 99 windows of 16 tokens (needs 1584)")
    assert "one of them" in one_line(capsys, ["verify"])
    assert "one of them" in one_line(capsys, ["verify", tmp_path, "--model", d])
    assert one_line(capsys, ["verify", tmp_path, "--modules", "0"]).endswith(
        "verify: --modules applies to --model DIR, not to a run directory; leave it out")


def test_analyze_measures_every_recurrent_module_or_those_picked(hybrid, tmp_path, capsys):
    d, text = hybrid
    base = ["analyze", "--model", str(d), "--text", str(text), "--windows", "2", "--length",
            "16", "--perturb-pos", "4", "--exponents", "2", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "all")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [str(tmp_path / "all" / "index.html")] + [
        str(tmp_path / "all" / p / "report.json") for p in PATHS]
    assert [ln.split(": verification:")[0] for ln in err.splitlines()] == PATHS
    index = (tmp_path / "all" / "index.html").read_text(encoding="utf-8")
    assert all(f'href="{p}/report.html"' in index for p in PATHS) and "Left alone:" in index
    reps = {p: json.loads((tmp_path / "all" / p / "report.json").read_text()) for p in PATHS}
    assert [r["model"]["path"] for r in reps.values()] == PATHS
    assert all(r["model"]["unit"] == "tokens" and r["verification"]["passed"]
               for r in reps.values())
    # the context used is the whole model's: measured once, the same in each report
    assert reps[PATHS[0]]["context"] == reps[PATHS[1]]["context"]
    # one picked (--layers, DESIGN's spelling, or --modules): written as a run's analysis is
    for flag in ("--layers", "--modules"):
        one = tmp_path / flag.strip("-")
        assert main([*base, flag, "-1", "--out", str(one)]) == 0
        assert capsys.readouterr().out.splitlines()[0] == str(one / "report.json")
        assert json.loads((one / "report.json").read_text()) == reps[PATHS[1]]
    assert one_line(capsys, [*base, "--layers", "0", "--modules", "1"]).endswith(
        "analyze: --layers and --modules say the same; give one")


def test_analyze_of_several_modules_says_each_and_the_time_left(hybrid, tmp_path, capsys):
    """Without --quiet, a line names each module before it is measured and, after it, its
    time and the modules left at that rate (analysis/estimate.py ``each_module``)."""
    d, text = hybrid
    assert main(["analyze", "--model", str(d), "--text", str(text), "--windows", "2",
                 "--length", "16", "--perturb-pos", "4", "--exponents", "2",
                 "--out", str(tmp_path / "a")]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines()
             if ln.startswith("gatelens analyze: model.")]
    assert [ln.split(" (")[0] for ln in lines[::2]] == [f"gatelens analyze: {p}" for p in PATHS]
    assert lines[0].endswith("(module 1 of 2)") and lines[2].endswith("(module 2 of 2)")
    assert " took " in lines[1] and "; the 1 module left ≈ " in lines[1]
    assert "; all 2 took " in lines[3]


def test_analyze_model_defaults_to_the_built_in_corpus_and_dir_analysis(
        hybrid, tmp_path, capsys, monkeypatch):
    """No --text: the built-in corpus's validation split (a cached copy here: nothing is
    fetched); no --out: DIR/analysis, as a run's is RUN/analysis."""
    import shutil

    from gatelens.training import corpus

    d, text = hybrid
    model = tmp_path / "copy"
    shutil.copytree(d, model)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shakespeare.txt").write_text(text.read_text(encoding="utf-8") * 10,
                                           encoding="utf-8")
    monkeypatch.setenv("GATELENS_CACHE", str(cache))
    monkeypatch.setattr(corpus, "fetch_shakespeare_archive", lambda d: pytest.fail("fetched"))
    assert main(["analyze", "--model", str(model), "--modules", "0", "--windows", "2",
                 "--length", "16", "--perturb-pos", "4", "--exponents", "0", "--quiet"]) == 0
    rep = json.loads((model / "analysis" / "report.json").read_text())
    assert rep["text"]["source"].startswith(
        "the built-in corpus shakespeare (validation split) (")
    capsys.readouterr()


def test_layers_is_a_count_with_weights_and_no_flag_of_a_run(tmp_path, capsys):
    assert one_line(capsys, ["analyze", "--weights", "w.pt", "--vocab", "v.json", "--text",
                             "t.txt", "--out", tmp_path, "--layers", "0,1"]).endswith(
        "w.pt: --layers with --weights is how many layers, a positive integer; got 0,1")
    assert one_line(capsys, ["analyze", tmp_path, "--layers", "2"]).endswith(
        "analyze: --layers applies to --weights FILE (how many) or --model DIR (which), not "
        "to a run directory; leave it out")


def test_lens_device_moves_the_model_and_gives_the_same_analysis(monkeypatch):
    """``Lens(..., device=)``: the CPU named is the analysis without it, figure for figure;
    "auto" is the CPU where PyTorch sees no CUDA device, and "cuda" there is one line (the
    CUDA path itself runs in benchmarks/gpu_check.py where a GPU is lent)."""
    import gatelens
    from gatelens.errors import GatelensError
    from gatelens.lens.device import resolve

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(5, 4),
                                   torch.nn.GRU(4, 6, batch_first=True))

    ids = torch.randint(0, 5, (2, 12), generator=torch.Generator().manual_seed(2))
    kw = {"perturb_pos": 3, "exponents": 2}
    plain = gatelens.Lens(model(), vocab=5).analyze(ids, **kw).reports["1"]
    lens = gatelens.Lens(model(), vocab=5, device="cpu")
    assert lens.device == torch.device("cpu")
    assert lens.analyze(ids, **kw).reports["1"] == plain
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve("auto") == torch.device("cpu")
    for bad, words in (("cuda", "device 'cuda': this PyTorch"), ("tpu", "device 'tpu': not a"),
                       ("meta", "device 'meta': it holds no values")):
        with pytest.raises(GatelensError, match=f"^{words}"):
            gatelens.Lens(model(), vocab=5, device=bad)


def test_analyze_device_flag(hybrid, tmp_path, capsys, monkeypatch):
    d, text = hybrid
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["analyze", "--model", str(d), "--text", str(text), "--windows", "2", "--length",
            "16", "--perturb-pos", "4", "--exponents", "0", "--modules", "0", "--quiet"]
    assert one_line(capsys, [*base, "--device", "cuda", "--out", tmp_path / "c"]).endswith(
        "device 'cuda': this PyTorch (" + torch.__version__ + ") sees no CUDA device; use cpu "
        "(or auto)")
    assert main([*base, "--device", "auto", "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    same = [json.loads((tmp_path / x / "report.json").read_text()) for x in "ab"]
    assert same[0] == same[1]
    # verify and patch take the same flag
    for cmd in (["verify", "--model", d, "--text", text, "--length", "16"],
                ["patch", "--model", d, "--text", text, "--length", "16", "--windows", "2",
                 "--perturb-pos", "4", "--out", tmp_path / "p"]):
        assert "device 'cuda': this PyTorch" in one_line(capsys, [*cmd, "--device", "cuda"])
        assert main([str(c) for c in cmd] + ["--device", "cpu"]) == 0
        capsys.readouterr()


def test_patch_model_sweeps_token_windows_as_patch_sweep_does(hybrid, tmp_path, capsys):
    """``gatelens patch --model DIR``: the same sweep as ``gatelens.patch_sweep`` on the
    checkpoint's model, the token at --perturb-pos replaced by one that occurs in the
    windows (as analyze draws it)."""
    import numpy as np

    import gatelens
    from gatelens.analysis.perturbation import perturb_windows
    from gatelens.loaders.hf_dir import load_hf

    d, text = hybrid
    out = tmp_path / "p"
    assert main(["patch", "--model", str(d), "--text", str(text), "--windows", "2",
                 "--length", "16", "--perturb-pos", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f) for f in ("patch.json", "patch.png", "patch.md")]
    doc = json.loads((out / "patch.json").read_text())
    assert doc["names"] == [f"{p}.layer0.s" for p in PATHS] and len(doc["positions"]) == 16
    assert doc["inputs"] == {"source": f"{text}, token 4 replaced", "perturb_pos": 4,
                             "model": str(d)}
    hf = load_hf(d)
    clean = hf.windows(text.read_text(encoding="utf-8"), 2, 16)
    corrupt = perturb_windows(clean, 4, hf.vocab_size, 0, clean.unique())
    assert bool((corrupt[:, 4] != clean[:, 4]).all()) and set(corrupt[:, 4].tolist()) <= set(
        clean.unique().tolist())
    want = gatelens.patch_sweep(gatelens.Lens(hf.model, vocab=hf.tokens(), unit="tokens"),
                                clean, corrupt)
    assert np.allclose(np.array(doc["effect"], dtype=float), want.effect, equal_nan=True,
                       rtol=0, atol=1e-12)
    # clean and corrupted texts in tokens; logit-diff between two tokens' texts
    tokens, clean_text = hf.tokens(), "the quick brown fox"
    n = len(hf.encode(clean_text))
    corrupt_text = next(t for w in sorted(set(TEXT.split()) - {"fox"})
                        if len(hf.encode(t := f"the quick brown {w}")) == n)
    a, b = tokens[10], tokens[11]
    assert main(["patch", "--model", str(d), "--clean", clean_text, "--corrupt", corrupt_text,
                 "--metric", "logit-diff", "--pair", f"{a},{b}", "--out", str(tmp_path / "q"),
                 "--quiet"]) == 0
    assert json.loads((tmp_path / "q" / "patch.json").read_text())["metric"].startswith(
        "logit_diff")


def test_patch_model_bad_input_is_one_line(hybrid, tmp_path, capsys):
    d, text = hybrid
    base = ["patch", "--model", d, "--out", tmp_path / "o"]
    n = [len(load_hf_tokens(d, t)) for t in ("the quick brown fox", "the lazy brown fox")]
    assert one_line(capsys, [*base, "--clean", "the quick brown fox", "--corrupt",
                             "the lazy brown fox"]).endswith(
        f"patch: --clean is {n[0]} tokens and --corrupt {n[1]}; they must be as many, and "
        "not none")
    assert one_line(capsys, [*base, "--checkpoint", "3"]).endswith(
        "patch: --checkpoint applies to a run directory, not to --model DIR; leave it out")
    assert one_line(capsys, [*base, "--text", text, "--length", "16", "--windows", "2",
                             "--metric", "logit-diff", "--pair", "zz,qq"]).endswith(
        "--pair: token 'zz' is not in the model's vocabulary of "
        f"{len(load_hf_tokens(d))} tokens")
    assert one_line(capsys, [*base, "--text", text, "--length", "16", "--windows", "2",
                             "--perturb-pos", "16"]).endswith(
        "--perturb-pos 16 is outside windows of 16 tokens (0..15)")
    assert "one of them" in one_line(capsys, ["patch"])
    assert "one of them" in one_line(capsys, ["patch", tmp_path, "--model", d])
    assert one_line(capsys, ["patch", tmp_path, "--trust-remote-code"]).endswith(
        "patch: --trust-remote-code applies to --model DIR, not to a run directory; leave "
        "it out")


def load_hf_tokens(d: Path, text: str | None = None) -> list:
    """The checkpoint's token texts, or the ids of ``text``."""
    from gatelens.loaders.hf_dir import load_hf

    hf = load_hf(d)
    return hf.tokens() if text is None else hf.encode(text).tolist()
