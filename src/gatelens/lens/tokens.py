"""Token units: a tokenizer handed to ``Lens(model, tokenizer=...)`` (docs/methods.md, "Tokens
and depth").

A tokenizer is a Hugging Face tokenizer (``PreTrainedTokenizerFast``), a ``tokenizers``
``Tokenizer``, or any object with ``encode(text) -> ids`` and ``decode(ids) -> text``. The
text is tokenised once, as a whole; the windows are its first B consecutive T-token slices.
Each token that occurs in the windows is shown by its decoded text (a word-start marker,
``Ġ`` or ``▁``, as the space it stands for); a token that does not occur is ``<id>``.

>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
>>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
>>> encode_text(tok, "a b a"), vocab_size(tok)
([0, 1, 0], 3)
>>> pieces(tok, [0, 1], 3)
['a', 'b', '<2>']
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gatelens.errors import GatelensError
from gatelens.report.words import UNITS
from gatelens.schema_check import PLACEHOLDER, check_chars

WORD_START = ("Ġ", "▁")  # GPT-2's byte-level BPE and SentencePiece mark a leading space so


class Utf8Bytes:
    """A byte model's tokenizer: a text's UTF-8 bytes are its ids 0..255 (what
    ``Lens(model, unit="bytes")`` reads a text with when given no vocabulary list and no
    tokenizer). A byte below 0x80 is shown as its character; one above, a piece of a
    character, as <0xNN>.

    >>> b = Utf8Bytes()
    >>> b.encode("é!"), b.decode([33]), b.decode([0xC3]), b.decode(b.encode("é!"))
    ([195, 169, 33], '!', '<0xC3>', 'é!')
    """

    def __len__(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", "surrogatepass"))

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if len(ids) == 1 and ids[0] >= 0x80:
            return f"<0x{ids[0]:02X}>"
        return bytes(ids).decode("utf-8", "replace")


def check_unit(unit: str) -> str:
    """A unit gatelens speaks of; anything else is one line."""
    if unit not in UNITS:
        raise GatelensError(f"unit {unit!r} is not one of {', '.join(UNITS)}")
    return unit


def check_tokenizer(tokenizer: Any) -> None:
    """A tokenizer must encode text and decode ids."""
    missing = [m for m in ("encode", "decode") if not callable(getattr(tokenizer, m, None))]
    if missing:
        raise GatelensError(f"tokenizer {type(tokenizer).__name__} has no "
                            f"{' or '.join(missing)}(): Lens needs encode(text) -> ids and "
                            "decode(ids) -> text")


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """The ids of ``text``, without special tokens where the tokenizer adds them."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a plain encode(text)
        out = tokenizer.encode(text)
    out = getattr(out, "ids", out)  # tokenizers' Encoding
    try:
        ids = [int(i) for i in out]
    except (TypeError, ValueError):
        raise GatelensError(f"tokenizer {type(tokenizer).__name__}.encode returned "
                            f"{type(out).__name__}, not a sequence of ids") from None
    if not ids:
        raise GatelensError("the tokenizer gives no tokens for this text")
    if min(ids) < 0:
        raise GatelensError(f"tokenizer {type(tokenizer).__name__} gave a negative id "
                            f"{min(ids)}")
    return ids


def vocab_size(tokenizer: Any) -> int | None:
    """How many ids the tokenizer has (added tokens included), or None if it cannot say."""
    for how in (lambda t: len(t), lambda t: t.get_vocab_size(with_added_tokens=True),
                lambda t: t.vocab_size):
        try:
            n = how(tokenizer)
        except (TypeError, AttributeError):
            continue
        if isinstance(n, int) and n > 0:
            return n
    return None


def piece(tokenizer: Any, i: int) -> str:
    """Token ``i`` as the text it stands for: its decoded text, a word-start marker shown
    as the leading space it means (SentencePiece's decode drops it)."""
    text = tokenizer.decode([i])
    raw = None
    for name in ("convert_ids_to_tokens", "id_to_token"):
        fn = getattr(tokenizer, name, None)
        if callable(fn):
            raw = fn(i)
            break
    if isinstance(raw, str) and raw[:1] in WORD_START and not text[:1].isspace():
        text = " " + text
    return text


def pieces(tokenizer: Any, occurring: Iterable[int], size: int) -> list[str]:
    """The vocabulary in id order as the page and the classes read it: the decoded text of
    every id in ``occurring``, ``<id>`` for the rest (a 50k vocabulary is not decoded)."""
    out = [f"<{i}>" for i in range(size)]
    for i in sorted(set(int(i) for i in occurring)):
        out[i] = piece(tokenizer, i)
    return out


def vocab_list(vocab: object, unit: str) -> list[str]:
    """``Lens(vocab=)`` as a list: in characters the one rule of ``--vocab`` files and
    config.json (``check_chars``); in tokens or bytes, a list of strings (a token's text)."""
    if isinstance(vocab, str) and unit == "characters":  # "abc": its characters
        vocab = list(vocab)
    if isinstance(vocab, bool) or not isinstance(vocab, Sequence) or isinstance(vocab, str):
        raise GatelensError(f"Lens(vocab=...) takes a list of {unit} or their number; got "
                            f"{type(vocab).__name__}")
    if unit == "characters":
        return check_chars(list(vocab), "Lens(vocab=...)", placeholders=True)
    bad = next((i for i, v in enumerate(vocab) if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise GatelensError(f"Lens(vocab=...): entry {bad} is {vocab[bad]!r}, not a "
                            "non-empty string")
    return list(vocab)


def names_tokens(vocab: object) -> bool:
    """Whether a ``Lens(vocab=)`` list is a token vocabulary (an entry of more than one
    character): the unit then defaults to tokens; single characters are characters.

    >>> names_tokens(["a", "b"]), names_tokens(["the", " cat"]), names_tokens(12)
    (False, True, False)
    >>> names_tokens(["a", "<unused 1>"])  # gatelens's name of a row no character names
    False
    """
    return (isinstance(vocab, Sequence) and not isinstance(vocab, str)
            and any(isinstance(v, str) and len(v) > 1 and not PLACEHOLDER.fullmatch(v)
                    for v in vocab))
