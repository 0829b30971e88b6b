"""Every Python example of the README and of the docs pages runs as written (issue 20: the
README's own Lens example once failed; issue 30: the examples moved to docs/*.md with the
text they belong to, and still run).

Each ```python block of README.md and docs/*.md is executed as printed in a fresh directory
that holds the files it names (my_text.txt; RUN/model.safetensors; model.onnx exported from
an nn.LSTM; model.h5, a Keras 2 hard-sigmoid LSTM written with h5py; a cell-loop model where
one is assumed), and what its comments promise is checked on the names it leaves. A new
block must be added to ``COVERED`` with a test of its own; a block printed on two pages
must be the same on both (the test runs it once). The Tutorials pages are not docs/*.md:
they are generated from docs/tutorials/*.py, which tests/test_notebooks.py runs.

The README's table of supported models is checked against the family registry here too.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def sources() -> list[Path]:
    """The pages whose Python blocks must run: the README and every docs/*.md."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def page_blocks(path: Path) -> list[str]:
    """One page's ```python blocks, in order, dedented to the fence's own indentation."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M):
        indent = len(m.group(1))
        out.append("\n".join(line[indent:] for line in m.group(2).splitlines()))
    return out


def blocks() -> list[str]:
    """Every page's ```python blocks, each distinct block once, in page order."""
    return list(dict.fromkeys(b for page in sources() for b in page_blocks(page)))


def find(word: str) -> str:
    found = [b for b in blocks() if word in b]
    assert found, f"no README or docs example uses {word}"
    assert len(found) == 1, f"{len(found)} different examples use {word}: one test runs one"
    return found[0]


#: a phrase that identifies each block, and the test that runs it
COVERED = {"load_file(\"RUN/model.safetensors\")": "test_checkpoint_example",
           "gatelens.trace(lstm": "test_trace_example",
           "class CharModel": "test_lens_example_reads_the_file_it_names",
           "gatelens.open_onnx(": "test_onnx_and_keras_example",
           "gatelens.open_cells(model)": "test_cell_loop_example",
           "lens.run(ids, edits=[": "test_interventions_example",
           "gatelens.patch_sweep(": "test_patching_example",
           "gatelens.load_hf(\"my_mamba\")": "test_token_example"}


def test_every_readme_example_is_run_by_a_test():
    for b in blocks():
        assert sum(word in b for word in COVERED) == 1, f"an example no test runs:\n{b}"
    assert len(blocks()) == len(COVERED)
    for name in COVERED.values():
        assert callable(globals()[name])
    readme = page_blocks(README)
    assert any("class CharModel" in b for b in readme)  # the quick start stays in the README
    assert any("gatelens.trace(lstm" in b for b in readme)


def test_the_block_rule_reaches_every_docs_page(tmp_path, monkeypatch):
    """A block on a docs page that no test runs fails the rule (so the rule can fail)."""
    page = ROOT / "docs" / "methods.md"
    assert page in sources()
    fake = tmp_path / "methods.md"
    fake.write_text(page.read_text(encoding="utf-8") + "\n```python\nprint('untested')\n```\n",
                    encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "sources", lambda: [README, fake])
    extra = [b for b in blocks() if not any(word in b for word in COVERED)]
    assert extra == ["print('untested')"]


def _readme_table() -> dict[str, tuple[bool, bool]]:
    """The README's supported-models table: family -> (train ✓, edits ✓)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Supported models"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `([^`]+)` \|[^|]*\|([^|]*)\|([^|]*)\|$", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = ("✓" in m.group(2), "✓" in m.group(3))
    return rows


def test_supported_models_table_is_the_registry(monkeypatch):
    """Every registered family has a row and every row is a registered family; the train
    column is the families with a ``gatelens train --cell`` recipe, the edits column those
    whose ``intervene`` is their own (Lens.run refuses the rest in one line)."""
    import gatelens
    from gatelens.families.base import Family
    from gatelens.families.registry import family_classes

    monkeypatch.delenv("GATELENS_FAMILIES", raising=False)
    rows = _readme_table()
    assert list(rows) == list(gatelens.families())  # the registry's order, too
    for cls in family_classes():
        train, edits = rows[cls.name]
        assert train == (cls.recipe is not None), cls.name
        assert edits == (cls.intervene is not Family.intervene), cls.name


def test_checkpoint_example(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(84, 325, batch_first=True)
    Path("RUN").mkdir()
    save_file({"rnn." + k: v for k, v in lstm.state_dict().items()}
              | {"head.weight": torch.zeros(84, 325)}, "RUN/model.safetensors")
    ns: dict = {}
    exec(find("load_file(\"RUN/model.safetensors\")"), ns)
    for k, v in lstm.state_dict().items():
        assert torch.equal(ns["lstm"].state_dict()[k], v), k


def test_trace_example(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(find("gatelens.trace(lstm"), ns)
    assert tuple(ns["tr"]["layer0.f"].shape) == (32, 128, 325)
    import gatelens

    assert gatelens.verify(ns["lstm"], ns["x"]).max_abs_diff_h < 1e-5


def test_lens_example_reads_the_file_it_names(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    words = "the cat sat on the mat and then the dog ran off to the park\n"
    Path("my_text.txt").write_text(words * 90, encoding="utf-8")  # 5,490 characters
    torch.manual_seed(0)
    ns: dict = {}
    exec(find("class CharModel"), ns)
    rep = ns["result"].reports["lstm"]
    assert rep["verification"]["passed"]
    a = ns["a"]  # the typed objects the example reads, and report.json agrees with them
    assert a is ns["result"].analyses["lstm"] and a.verification.passed is True
    assert a.units.half_life["median"] == rep["units"]["half_life"]["median"]
    assert a.perturbation.half_life_measured == rep["perturbation"]["half_life_measured"] > 0
    assert 0 < a.perturbation.half_life_forget_only
    assert a.reach.half_life == rep["output_reach"]["half_life"] > 0
    assert rep["text"]["windows"] == 32 and "my_text.txt" in rep["text"]["source"]
    assert Path("lens_out/lstm/report.json").is_file() and Path("lens_out/index.html").is_file()


def test_token_example(monkeypatch, tmp_path):
    """The README's token example on a local directory made as a user's would be: a small
    transformers Mamba saved with save_pretrained beside a BPE tokenizer trained here."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    monkeypatch.chdir(tmp_path)
    text = "the cat sat on the mat and then the dog ran off to the park\n" * 60
    Path("my_text.txt").write_text(text, encoding="utf-8")
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=40, special_tokens=["[UNK]"]))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=len(tok), hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=3, time_step_rank=2)).save_pretrained("my_mamba")
    tok.save_pretrained("my_mamba")
    ns: dict = {}
    exec(find("gatelens.load_hf(\"my_mamba\")"), ns)
    rep = ns["result"].reports["backbone"]
    assert rep["model"]["unit"] == "tokens" and ns["a"].verification.passed is True
    assert ns["a"].perturbation.half_life_measured == rep["perturbation"]["half_life_measured"]
    assert rep["text"]["windows"] == 8 and Path("mamba_out/backbone/report.json").is_file()
    md = Path("mamba_out/backbone/report.md").read_text(encoding="utf-8")
    assert "tokens" in md and "in characters" not in md
    # the command lines printed beside it run as printed, on the same directory
    from gatelens.cli import main

    lines = [ln.strip() for ln in README.read_text(encoding="utf-8").splitlines()
             if ln.strip().startswith(("gatelens analyze --model my_mamba",
                                       "gatelens verify --model my_mamba"))]
    assert len(lines) == 2
    for line in lines:
        assert main(shlex.split(line)[1:]) == 0, line
    cli = json.loads(Path("mamba_cli/report.json").read_text(encoding="utf-8"))
    assert cli["perturbation"] == rep["perturbation"]  # the same figures as Lens gave


def _keras2_hard_sigmoid_h5(path: Path, units: int = 4, features: int = 3) -> None:
    """A Keras 2 Sequential file with one hard-sigmoid LSTM "lstm_1", written with h5py."""
    import h5py

    rng = np.random.default_rng(0)
    cfg = {"name": "lstm_1", "units": units, "activation": "tanh",
           "recurrent_activation": "hard_sigmoid", "use_bias": True,
           "batch_input_shape": [None, None, features]}
    model = {"class_name": "Sequential", "config": {"name": "s", "layers": [
        {"class_name": "LSTM", "config": cfg}]}}
    shapes = {"kernel": (features, 4 * units), "recurrent_kernel": (units, 4 * units),
              "bias": (4 * units,)}
    with h5py.File(path, "w") as f:
        f.attrs["keras_version"], f.attrs["backend"] = b"2.2.4", b"tensorflow"
        f.attrs["model_config"] = json.dumps(model).encode()
        root = f.create_group("model_weights")
        root.attrs["keras_version"] = b"2.2.4"
        root.attrs["layer_names"] = [b"lstm_1"]
        g = root.create_group("lstm_1")
        names = [f"lstm_1/{k}:0" for k in shapes]
        g.attrs["weight_names"] = [n.encode() for n in names]
        for n, shape in zip(names, shapes.values(), strict=True):
            g.create_dataset(n, data=rng.normal(size=shape).astype(np.float32) * 0.5)


def test_onnx_and_keras_example(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on batch sizes
        torch.onnx.export(torch.nn.LSTM(8, 16).eval(), (torch.zeros(20, 1, 8),), "model.onnx",
                          input_names=["x"], dynamo=False)
    _keras2_hard_sigmoid_h5(Path("model.h5"))
    ns: dict = {}
    exec(find("gatelens.open_onnx("), ns)
    assert isinstance(ns["mods"]["/LSTM"], torch.nn.LSTM)
    assert tuple(ns["traces"]["/LSTM"]["layer0.f"].shape) == (1, 20, 16)
    assert ns["traces"]["/LSTM"].meta["onnx_max_abs_diff_h"] < 1e-5
    assert ns["layers"]["lstm_1"].keras_layer["definition"].startswith("clip(0.2")


def test_cell_loop_example(monkeypatch, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
    from cell_models import CHARS, TEXT, B, E, H, T, ids, trained

    monkeypatch.chdir(tmp_path)
    Path("my_text.txt").write_text(TEXT * 2, encoding="utf-8")  # 32 windows of 128 fit
    model = trained("lstm")
    ns = {"model": model, "ids": ids(), "chars": CHARS, "x": torch.randn(B, T, E),
          "h0": torch.zeros(B, H), "c0": torch.zeros(B, H)}
    block = find("gatelens.open_cells(model)")
    exec("import gatelens\n" + block.replace("gatelens.Lens(", "result = gatelens.Lens("), ns)
    assert tuple(ns["cache"]["cell.layer0.f"].shape) == (B, T, H)
    assert ns["result"].reports["cell"]["verification"]["passed"]


def test_interventions_example(monkeypatch, tmp_path):
    import gatelens

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    V, T = 9, 64

    class CharModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, 16)
            self.lstm = torch.nn.LSTM(16, 24, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(24, V)

        def forward(self, ids):
            return self.head(self.lstm(self.embed(ids))[0])

    model, g = CharModel(), torch.Generator().manual_seed(1)
    ids, other = (torch.randint(0, V, (2, T), generator=g) for _ in range(2))
    ns = {"model": model, "ids": ids, "other_ids": other, "v": torch.randn(24)}
    exec(find("lens.run(ids, edits=["), ns)
    c = ns["res"].trace["lstm.layer0.c"][:, 31:, [5, 17]]
    assert torch.equal(c, c[:, :1].expand_as(c))  # held exactly, as the comment says
    with torch.no_grad():
        own = model(ids)
    out = ns["res"].output
    assert torch.equal(out[:, :32], own[:, :32]) and not torch.allclose(out[:, 32:], own[:, 32:])
    assert gatelens.Set in (type(e) for e in ns["res"].edits)


def test_patching_example(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    V, T = 9, 24

    class CharModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, 16)
            self.lstm = torch.nn.LSTM(16, 24, num_layers=2, batch_first=True)
            self.head = torch.nn.Linear(24, V)

        def forward(self, ids):
            return self.head(self.lstm(self.embed(ids))[0])

    clean = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    corrupt = clean.clone()
    corrupt[:, 18] = (clean[:, 18] + 1) % V
    ns = {"model": CharModel(), "clean_ids": clean, "corrupt_ids": corrupt, "a": 1, "b": 2}
    exec(find("gatelens.patch_sweep("), ns)
    res = ns["res"]
    assert res.effect.shape == (3, T) and res.names[2] == "lstm.layer0.c + lstm.layer0.h"
    assert abs(res.patched[:, :18] - res.m_corrupt).max() <= 1e-6  # before the change: equal
    # at 18, layer 0's whole state clean makes layer 1's clean too (its state at 17 is)
    assert abs(res.patched[2, 18] - res.m_clean) <= 1e-5
    assert res.attribution.shape == (3, T) and -1 <= res.spearman <= 1

