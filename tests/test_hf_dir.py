"""Local Hugging Face checkpoints: ``gatelens.load_hf(DIR)`` and ``gatelens analyze --model``.

Every directory is made here: a small random transformers model saved with
``save_pretrained`` beside a tokenizer trained in the test with the ``tokenizers`` library
(a BPE over the test's own text); nothing is downloaded.
"""

from __future__ import annotations

import json
import pickle
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

import gatelens
from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.lens.lens import Lens
from gatelens.lens.tokens import piece
from gatelens.loaders.hf_dir import load_hf

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import one_line  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog and then runs home to sleep".split()
TEXT = "\n".join(" ".join(WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(8))
                 for i in range(40))

pytestmark = pytest.mark.usefixtures("one_thread")


def trained_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A small BPE (Metaspace: the spaces are kept) trained on TEXT, wrapped for transformers."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=48,
                                                         special_tokens=["[UNK]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def save_mamba(d: Path, tokenizer=None, vocab: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    tokenizer = tokenizer or trained_tokenizer()
    cfg = transformers.MambaConfig(vocab_size=vocab or len(tokenizer), hidden_size=16,
                                   state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3,
                                   time_step_rank=2)
    model = transformers.MambaForCausalLM(cfg).eval()
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, nn.Module, transformers.PreTrainedTokenizerFast]:
    transformers.utils.logging.set_verbosity_error()
    d = tmp_path_factory.mktemp("hf") / "mamba"
    tok = trained_tokenizer()
    return d, save_mamba(d, tok), tok


@pytest.fixture
def text(tmp_path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(TEXT, encoding="utf-8")
    return p


def test_load_hf_opens_the_directory_offline_with_its_tokenizer(ckpt, monkeypatch):
    d, original, tok = ckpt
    tried = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, *a: tried.append(a))
    hf = load_hf(d)
    assert tried == []  # no connection was even attempted
    model, tokenizer = hf  # unpacks as (model, tokenizer)
    assert gatelens.load_hf is load_hf and isinstance(hf, gatelens.HFModel)
    assert type(model) is transformers.MambaForCausalLM and not model.training
    assert hf.model_type == "mamba" and hf.directory == d and hf.notes == ()
    state = original.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert tokenizer(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert hf.encode(TEXT).tolist() == tok(TEXT, add_special_tokens=False)["input_ids"]
    vocab = hf.tokens()
    assert len(vocab) == hf.vocab_size == len(tok)
    assert vocab[tok.convert_tokens_to_ids("▁the")] == tok.decode([tok.convert_tokens_to_ids(
        "▁the")])
    assert "MambaForCausalLM" in hf.describe() and f"{len(tok)} tokens" in hf.describe()


def test_load_hf_asks_transformers_for_local_files_and_never_remote_code(ckpt, monkeypatch):
    d = ckpt[0]
    seen = []
    for cls in (transformers.AutoConfig, transformers.MambaForCausalLM,
                transformers.AutoTokenizer):
        real = cls.from_pretrained.__func__

        def spy(klass, *a, real=real, **kw):
            seen.append((klass.__name__, kw))
            return real(klass, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    load_hf(d)
    names = [n for n, _ in seen]
    assert {"AutoConfig", "MambaForCausalLM", "AutoTokenizer"} <= set(names)
    for name, kw in seen:
        assert kw.get("local_files_only") is True, name
        assert not kw.get("trust_remote_code"), name
    assert dict(seen)["MambaForCausalLM"]["use_safetensors"] is True


CONFIGURATION_TOY = """from transformers import PretrainedConfig

open(MARKER, "w").close()  # the directory's own code ran


class ToyConfig(PretrainedConfig):
    model_type = "gatelens-toy"

    def __init__(self, vocab_size=10, hidden=6, **kwargs):
        self.vocab_size, self.hidden = vocab_size, hidden
        super().__init__(**kwargs)
"""
MODELING_TOY = """from torch import nn
from transformers import PreTrainedModel

from .configuration_toy import ToyConfig


class ToyForCausalLM(PreTrainedModel):
    config_class = ToyConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, 4)
        self.lstm = nn.LSTM(4, config.hidden, batch_first=True)
        self.head = nn.Linear(config.hidden, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, **kwargs):
        return self.head(self.lstm(self.embed(input_ids))[0])
"""


def remote_dir(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A directory whose model is its own Python code (config.json's auto_map): an LSTM LM."""
    d, marker = tmp_path / "remote", tmp_path / "ran"
    d.mkdir()
    (d / "configuration_toy.py").write_text(CONFIGURATION_TOY.replace("MARKER",
                                                                      repr(str(marker))))
    (d / "modeling_toy.py").write_text(MODELING_TOY)
    (d / "config.json").write_text(json.dumps({
        "model_type": "gatelens-toy", "vocab_size": 10, "hidden": 6,
        "architectures": ["ToyForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_toy.ToyConfig",
                     "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"}}))
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6, batch_first=True).state_dict()
    tensors = {"embed.weight": torch.randn(10, 4), "head.weight": torch.randn(10, 6),
               "head.bias": torch.zeros(10), **{f"lstm.{k}": v for k, v in lstm.items()}}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, marker, tensors


def test_remote_code_is_refused_unless_asked_for(tmp_path, capsys, monkeypatch):
    d, marker, tensors = remote_dir(tmp_path)
    msg = one_line(capsys, ["analyze", "--model", d, "--text", d / "config.json",
                            "--out", tmp_path / "out"])
    assert f"{d}/config.json: model_type 'gatelens-toy'" in msg and "--trust-remote-code" in msg
    assert not marker.exists()  # the directory's code never ran
    # asked for: transformers runs the directory's code (its copy kept under tmp_path)
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    hf = load_hf(d, trust_remote_code=True)
    assert marker.exists() and type(hf.model).__name__ == "ToyForCausalLM"
    assert torch.equal(hf.model.lstm.weight_hh_l0, tensors["lstm.weight_hh_l0"])
    assert list(Lens(hf.model, vocab=hf.tokens()).families) == ["lstm"]
    # --trust-remote-code reaches load_hf
    called = {}

    def fake(directory, trust_remote_code=False):
        called["trust"] = trust_remote_code
        raise GatelensError("stop here")

    monkeypatch.setattr("gatelens.loaders.hf_analyze.load_hf", fake)
    msg = one_line(capsys, ["analyze", "--model", d, "--text", d / "config.json", "--out",
                            tmp_path / "out", "--trust-remote-code"])
    assert called == {"trust": True} and msg.endswith("stop here")


class Unpickled:
    """Unpickling this writes a file: a pickle must never be opened."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_bad_directories_are_one_line_errors(ckpt, tmp_path, capsys):
    d, _, _ = ckpt

    def variant(name: str, drop=(), config: dict | None = None) -> Path:
        out = tmp_path / name
        shutil.copytree(d, out)
        for f in drop:
            (out / f).unlink()
        if config is not None:
            (out / "config.json").write_text(json.dumps(config))
        return out

    marker = tmp_path / "unpickled"
    pickled = variant("pickled", drop=["model.safetensors"])
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(Unpickled(str(marker))))
    partial = variant("partial")
    tensors = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "layers.1." not in k},
              str(partial / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    broken = variant("broken")
    (broken / "config.json").write_text("{not json")
    cases = {
        tmp_path / "nowhere": "no such directory",
        variant("noconfig", drop=["config.json"]): "no config.json",
        broken: "config.json: not JSON",
        variant("notype", config={k: v for k, v in cfg.items() if k != "model_type"}):
            'no "model_type"',
        variant("unknown", config={**cfg, "model_type": "not-a-model"}):
            "model_type 'not-a-model' is not one transformers",
        pickled: "the weights are pickles only (pytorch_model.bin); gatelens never unpickles",
        variant("noweights", drop=["model.safetensors"]): "no weights (*.safetensors)",
        partial: "the weights lack",
    }
    for where, words in cases.items():
        msg = one_line(capsys, ["analyze", "--model", where, "--text", d / "config.json",
                                "--out", tmp_path / "out"])
        assert msg.startswith(f"gatelens: error: {where}") and words in msg, msg
        with pytest.raises(GatelensError, match="^" + str(where)):
            load_hf(where)
    assert not marker.exists()


def test_a_model_with_no_recurrent_module_is_one_line(tmp_path):
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=20, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    gpt.save_pretrained(tmp_path / "gpt")
    with pytest.raises(GatelensError, match="GPT2LMHeadModel: nothing in it is a recurrence"):
        load_hf(tmp_path / "gpt")


def test_text_needs_the_tokenizer_and_enough_tokens(ckpt, tmp_path, text, capsys):
    d, _, tok = ckpt
    bare = tmp_path / "bare"
    shutil.copytree(d, bare)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (bare / f).unlink()
    hf = load_hf(bare)
    assert hf.tokenizer is None and hf.tokens()[:2] == ["<0>", "<1>"]
    msg = one_line(capsys, ["analyze", "--model", bare, "--text", text, "--out",
                            tmp_path / "o1"])
    assert "no tokenizer files" in msg
    n = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    msg = one_line(capsys, ["analyze", "--model", d, "--text", text, "--windows", "2",
                            "--length", str(n), "--out", tmp_path / "o2"])
    assert f"{text}: {n} tokens, too few for 2 windows of {n} tokens" in msg
    # the unit is tokens, in the errors too; a flag of another source is refused
    base = ["analyze", "--model", d, "--text", text, "--length", "16", "--out", tmp_path / "o4"]
    assert one_line(capsys, [*base, "--perturb-pos", "15"]).endswith(
        "--perturb-pos 15 leaves no lag in windows of 16 tokens (0..14)")
    assert one_line(capsys, [*base, "--checkpoint", "final"]).endswith(
        "analyze: --checkpoint applies to a run directory, not to --model DIR; leave it out")
    assert "--vocab applies to --weights FILE" in one_line(capsys, [*base, "--vocab", "v.json"])
    assert one_line(capsys, [*base, "--perturb-pos", "4", "--modules", "3"]).endswith(
        "--modules: 3 is not one of the 1 recurrent modules (0..0, or -1..-1)")
    for both in (["run", "--model", d], ["--weights", "w.pt", "--model", d], []):
        assert "one of them" in one_line(capsys, ["analyze", *both])
    # no --out and no run directory: one line, not a TypeError (the dispatch reads run first)
    assert "--out DIR" in one_line(capsys, ["analyze", "--weights", "w.pt", "--vocab", "v.json",
                                            "--text", text])
    # a tokenizer that gives ids past the model's embedding
    small = tmp_path / "small"
    save_mamba(small, tok, vocab=8)
    with pytest.raises(GatelensError, match="the model's embedding has 8 rows"):
        load_hf(small).encode(TEXT)


def test_analyze_model_dir_end_to_end_on_token_windows(ckpt, tmp_path, text, capsys,
                                                       monkeypatch):
    d, _, tok = ckpt
    out = tmp_path / "out"
    seen = {}
    real = Lens.measure

    def measure(self, path, ids, chars, **kw):
        seen.update(path=path, ids=ids, chars=chars)
        return real(self, path, ids, chars, **kw)

    monkeypatch.setattr(Lens, "measure", measure)
    argv = ["analyze", "--model", d, "--text", text, "--windows", "2", "--length", "24",
            "--perturb-pos", "4", "--exponents", "2", "--out", out, "--quiet"]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr()
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "report.json"), str(out / "report.md")]
    rep = json.loads((out / "report.json").read_text())
    n = len(tok(TEXT, add_special_tokens=False)["input_ids"])
    assert rep["model"]["path"] == "backbone" and rep["model"]["family"] == "hf-mamba"
    assert rep["model"]["checkpoint"] == str(d) and rep["model"]["model_type"] == "mamba"
    assert rep["text"]["windows"] == 2 and rep["text"]["length"] == 24
    assert rep["text"]["source"] == f"{text} ({n} tokens; first 2 windows of 24 tokens)"
    # the whole model read the tokenizer's first 2 x 24 ids; the vocabulary is the tokens'
    ids = tok(TEXT, add_special_tokens=False)["input_ids"][:48]
    assert seen["path"] == "backbone" and seen["ids"].tolist() == [ids[:24], ids[24:]]
    assert [seen["chars"][i] for i in ids] == [piece(tok, i) for i in ids]  # each token
    assert rep["verification"]["passed"] is True and rep["model"]["unit"] == "tokens"
    assert "24 tokens" in (out / "report.md").read_text()
    assert (out / "report.html").is_file()


@pytest.mark.parametrize("config, cls, path, sizes", [
    ("MambaConfig", "MambaForCausalLM", "backbone",
     {"state_size": 4, "expand": 2, "conv_kernel": 3, "time_step_rank": 2}),
    ("Mamba2Config", "Mamba2ForCausalLM", "backbone",
     {"state_size": 4, "num_heads": 4, "head_dim": 8, "expand": 2, "n_groups": 2,
      "conv_kernel": 3, "chunk_size": 8}),
    ("RwkvConfig", "RwkvForCausalLM", "rwkv",
     {"context_length": 32, "attention_hidden_size": 16, "intermediate_size": 32})])
def test_every_transformers_family_round_trips_through_its_directory(tmp_path, config, cls,
                                                                     path, sizes):
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(vocab_size=20, hidden_size=16, num_hidden_layers=2,
                                        **sizes)
    original = getattr(transformers, cls)(cfg).eval()
    original.save_pretrained(tmp_path)
    hf = load_hf(tmp_path)
    assert type(hf.model).__name__ == cls and hf.tokenizer is None
    assert list(Lens(hf.model, vocab=hf.tokens()).families) == [path]
    ids = torch.randint(0, 20, (2, 6))
    with torch.no_grad():
        assert torch.equal(hf.model(ids, use_cache=False).logits,
                           original(ids, use_cache=False).logits)
