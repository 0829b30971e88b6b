"""Token units: ``Lens(model, tokenizer=...)`` reads a text as tokens (docs/methods.md "Tokens
and depth"): token windows, the replacement drawn from the tokens occurring in the windows
and never the original, token classes, and every report speaking of tokens.

The tokenizer is trained here with the ``tokenizers`` library (byte-level BPE, GPT-2's word
start marker Ġ) and wrapped as transformers' PreTrainedTokenizerFast: nothing is downloaded.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import gatelens
from gatelens.analysis import perturb_windows
from gatelens.errors import GatelensError
from gatelens.lens.tokens import encode_text, piece

TEXT = ("the cat sat on the mat.\nthe dog sat on the log, and the cat ran.\n"
        "a bird sang; the dog slept.\n") * 12


@pytest.fixture(scope="module")
def tok():
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def _model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, 8)
            self.lstm = torch.nn.LSTM(8, 12, batch_first=True)
            self.head = torch.nn.Linear(12, vocab)

        def forward(self, ids):
            return self.head(self.lstm(self.embed(ids))[0])

    return LM()


def test_token_windows_perturbation_and_classes(tok, tmp_path) -> None:
    V = len(tok)
    lens = gatelens.Lens(_model(V), tokenizer=tok)
    res = lens.analyze(TEXT, windows=3, length=24, perturb_pos=5, exponents=2,
                       out=tmp_path / "a")
    a = res.analyses["lstm"]
    ids = torch.tensor(tok.encode(TEXT, add_special_tokens=False))
    assert torch.equal(a.windows, ids[: 3 * 24].view(3, 24))  # one tokenisation, 3 slices
    occurring = set(a.windows.unique().tolist())
    new, old = a.perturbed[:, 5], a.windows[:, 5]
    assert bool((new != old).all()) and set(new.tolist()) <= occurring
    assert torch.equal(a.perturbed, perturb_windows(a.windows, 5, V, 0, a.windows.unique()))
    rep = a.report
    assert rep["model"]["unit"] == "tokens"
    classes = rep["char_classes"]
    assert set(classes) == {"space", "newline", "punctuation", "other"}
    assert sum(c["positions"] for c in classes.values()) == 3 * 24
    # by hand: the class of every token position from its text
    want = {"space": 0, "newline": 0, "punctuation": 0, "other": 0}
    for i in a.windows.reshape(-1).tolist():
        text = tok.decode([i])
        k = ("newline" if "\n" in text else "space" if text[:1] == " " else
             "punctuation" if text in ".,;" else "other")
        want[k] += 1
    assert {k: v["positions"] for k, v in classes.items()} == want
    assert want["space"] > 0 and want["newline"] > 0 and want["punctuation"] > 0
    # every report speaks of tokens
    md = (tmp_path / "a" / "lstm" / "report.md").read_text()
    assert "24 tokens" in md  # the Text: line also says how many characters the text has
    assert "character" not in "\n".join(md.splitlines()[3:]).lower()
    assert not re.findall(r"\bchars?\b", "\n".join(md.splitlines()[3:]))  # nor "(chars)"
    index = (tmp_path / "a" / "index.html").read_text()
    assert "perturbation half-life (tokens)" in index and not re.findall(r"\bchars?\b", index)
    saved = json.loads((tmp_path / "a" / "lstm" / "report.json").read_text())
    words = json.dumps({k: saved[k] for k in ("divergence", "output_reach", "lyapunov",
                                              "context", "verification")})
    assert "character" not in words and "token" in words
    page = (tmp_path / "a" / "lstm" / "report.html").read_text()
    body = page.split("</style>")[1].split("<script")[0]  # the page's own words
    assert "character" not in body.lower() and "token" in body
    assert a.chars[int(a.windows[0, 1])] == tok.decode([int(a.windows[0, 1])])


def test_token_pieces_show_word_starts(tok) -> None:
    ids = encode_text(tok, "the cat")
    assert [piece(tok, i) for i in ids] == ["the", " cat"]
    assert tok.convert_ids_to_tokens(ids[1]).startswith("Ġ")


def test_character_models_keep_their_rules() -> None:
    net = torch.nn.Sequential(torch.nn.Embedding(3, 4), torch.nn.GRU(4, 5, batch_first=True))
    a = gatelens.Lens(net, vocab=list("ab ")).analyze("ab ba " * 20, windows=2, length=24,
                                                      perturb_pos=4).analyses["1"]
    assert a.report["model"]["unit"] == "characters"
    assert set(a.report["char_classes"]) == {"space", "newline", "other"}
    assert torch.equal(a.perturbed, perturb_windows(a.windows, 4, 3, 0))
    assert "characters" in a.report["divergence"]["description"]


def test_bytes_is_a_unit() -> None:
    net = torch.nn.Sequential(torch.nn.Embedding(256, 4), torch.nn.GRU(4, 5, batch_first=True))
    ids = torch.tensor(list(b"hello world, hello bytes.\n" * 4)).view(4, 26)
    a = gatelens.Lens(net, 256, unit="bytes").analyze(ids, perturb_pos=3).analyses["1"]
    assert a.report["model"]["unit"] == "bytes" and "bytes" in a.report["divergence"][
        "description"]
    assert set(a.perturbed[:, 3].tolist()) <= set(ids.unique().tolist())


def test_a_byte_model_reads_a_text_as_its_utf8_bytes() -> None:
    """unit="bytes" with no vocabulary list (or one of 256 and more ids): a text's UTF-8
    bytes are its ids, shown as characters below 0x80 and <0xNN> above; their classes are
    the token classes (the newline byte is a newline)."""
    net = torch.nn.Sequential(torch.nn.Embedding(256, 4), torch.nn.GRU(4, 5, batch_first=True))
    text = "ça va, très bien\n" * 8  # 2 two-byte characters a line: 17 characters, 19 bytes
    res = gatelens.Lens(net, unit="bytes").analyze(text, windows=3, length=40, perturb_pos=5)
    a = res.analyses["1"]
    assert torch.equal(a.windows.flatten(), torch.tensor(list(text.encode())[:120]))
    assert a.report["model"]["unit"] == "bytes"
    assert a.report["text"]["source"] == ("text (136 characters, as UTF-8 bytes; first 3 "
                                          "windows of 40 bytes)")
    assert a.chars[0xC3] == "<0xC3>" and a.chars[ord("a")] == "a" and a.chars[10] == "\n"
    assert a.report["char_classes"]["newline"]["positions"] == 6  # 120 bytes, 6 lines
    again = gatelens.Lens(net, 256, unit="bytes").analyze(text, windows=3, length=40,
                                                          perturb_pos=5)
    assert again.reports["1"]["text"] == a.report["text"]
    assert torch.equal(again.analyses["1"].windows, a.windows)
    with pytest.raises(GatelensError, match=r"a byte model reads a text as its UTF-8 bytes, "
                                            r"ids 0..255; Lens\(vocab=100\) holds fewer"):
        gatelens.Lens(net, 100, unit="bytes").analyze(text, windows=3, length=40)
    with pytest.raises(GatelensError, match="text: 152 bytes, too short for 4 windows of 40"):
        gatelens.Lens(net, unit="bytes").analyze(text, windows=4, length=40)
    ascii_net = torch.nn.Sequential(torch.nn.Embedding(128, 4),
                                    torch.nn.GRU(4, 5, batch_first=True))
    lens = gatelens.Lens(ascii_net, unit="bytes")  # its ids are still read
    assert lens.analyze(torch.tensor([list(b"abc, abc.\n" * 4)] * 2), perturb_pos=3
                        ).reports["1"]["model"]["unit"] == "bytes"
    with pytest.raises(GatelensError, match=r"ids 0..255; Sequential's embedding \(128 rows\) "
                                            r"holds fewer$"):
        lens.analyze(text, windows=3, length=40)


def test_bad_tokenizer_input_is_one_line(tok) -> None:
    m = _model(len(tok))
    with pytest.raises(GatelensError, match="vocab= or tokenizer=, not both"):
        gatelens.Lens(m, vocab=list("ab"), tokenizer=tok)
    with pytest.raises(GatelensError, match="has no decode"):
        gatelens.Lens(m, tokenizer=type("Enc", (), {"encode": lambda self, t: [1]})())
    with pytest.raises(GatelensError, match="unit 'words' is not one of characters, tokens"):
        gatelens.Lens(m, tokenizer=tok, unit="words")
    with pytest.raises(GatelensError, match=f"the tokenizer has {len(tok)} ids but LM reads 7"):
        gatelens.Lens(_model(7), tokenizer=tok)
    with pytest.raises(GatelensError, match="too short for 40 windows of 24 tokens"):
        gatelens.Lens(m, tokenizer=tok).analyze(TEXT, windows=40, length=24)
    one = torch.full((2, 16), 5, dtype=torch.long)  # ids, read as tokens
    with pytest.raises(GatelensError, match="one distinct token"):
        gatelens.Lens(m, tokenizer=tok).analyze(one, perturb_pos=3)
