"""Reading the files of a model gatelens did not train: its tensors and its vocabulary.

Tensors come from ``.safetensors`` or from ``torch.load(weights_only=True)`` only, which
refuses pickled Python objects; a vocabulary is JSON or a text (its sorted characters).
Every failure is a one-line GatelensError that names the file: a file that is not a
regular file (a directory, a device, a FIFO) or is larger than ``gatelens.io.TEXT_CAP``
is refused before it is opened for reading, and tensors holding NaN or Inf are refused
unless ``read_tensors(..., check_finite=False)``.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from gatelens.errors import GatelensError
from gatelens.io import NO_CAP, check_regular, read_utf8
from gatelens.training.corpus import Vocab
from gatelens.training.runs import refuse_nonfinite

SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
PICKLED = ("holds pickled Python objects, not plain tensors; gatelens reads only tensors "
           "(safetensors, or a state_dict saved with torch.save(model.state_dict()))")

PathLike = str | os.PathLike


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _check_file(p: Path, what: str, cap: int | None = None) -> None:
    check_regular(p, what, cap)  # exists, a regular file (no device, FIFO), within the cap
    if p.stat().st_size == 0:
        raise GatelensError(f"{p}: empty file, expected {what}")


def read_tensors(path: PathLike, check_finite: bool = True) -> dict[str, Tensor]:
    """The tensors of a ``.safetensors`` file or a saved state_dict, by name, on the CPU.

    A state_dict nested under "state_dict" or "model" (a training checkpoint) is found.
    A tensor holding NaN or Inf is a GatelensError naming it unless ``check_finite=False``.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "w.pt"
    >>> torch.save({"epoch": 3, "model": torch.nn.Linear(2, 1).state_dict()}, p)
    >>> sorted(read_tensors(p))
    ['bias', 'weight']
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise GatelensError(f"{p}: unknown weights format {suffix or '(no extension)'!r}; "
                            f"gatelens reads {', '.join(SUFFIXES)}")
    _check_file(p, "a weights file", NO_CAP)
    if suffix == ".safetensors":
        try:
            obj: object = load_file(str(p))
        except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as e:
            raise GatelensError(f"{p}: not a readable safetensors file ({_one_line(e)})") from None
        except BaseException as e:  # a panic in safetensors' Rust code is a BaseException
            if type(e).__name__ != "PanicException":
                raise
            raise GatelensError(f"{p}: not a readable safetensors file ({_one_line(e)})") from None
    else:
        try:
            with warnings.catch_warnings():  # torch's notes on pickle protocols: we refuse anyway
                warnings.simplefilter("ignore")
                obj = torch.load(p, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:
            if "weights only load failed" in str(e).lower():
                raise GatelensError(f"{p}: {PICKLED}") from None
            raise GatelensError(f"{p}: not a readable PyTorch file ({_one_line(e)})") from None
        except Exception as e:  # a corrupt file can fail anywhere inside torch.load
            raise GatelensError(f"{p}: not a readable PyTorch file "
                                f"({type(e).__name__}: {_one_line(e)})") from None
        except BaseException as e:  # e.g. a RecursionError's cousins, a Rust panic
            if type(e).__name__ != "PanicException":
                raise
            raise GatelensError(f"{p}: not a readable PyTorch file ({_one_line(e)})") from None
    if isinstance(obj, dict):
        obj = next((obj[k] for k in ("state_dict", "model") if isinstance(obj.get(k), dict)), obj)
    if not isinstance(obj, dict):
        raise GatelensError(f"{p}: holds an object of type {type(obj).__name__}, not a dict of "
                            "tensors (a state_dict)")
    if not obj:
        raise GatelensError(f"{p}: holds no tensors")
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, Tensor):
            raise GatelensError(f"{p}: entry {k!r} is of type {type(v).__name__}, not a tensor; "
                                "expected a state_dict (names to tensors)")
    if check_finite:
        refuse_nonfinite(p, obj)
    return dict(obj)


def read_vocab(path: PathLike) -> list[str]:
    """The model's characters in index order, from a UTF-8 file.

    A ``.json`` file holds a list of characters (``["a", "b"]``), or an object with that
    list under "chars" or "vocab" (so a gatelens run's config.json works). Any other file
    is a text whose sorted set of characters is the vocabulary: gatelens's own rule for a
    corpus (:meth:`Vocab.from_text`), so the training text itself will do.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "v.json"
    >>> _ = p.write_text('{"chars": ["\\\\n", " ", "a"]}')
    >>> read_vocab(p)
    ['\\n', ' ', 'a']
    """
    p = Path(path)
    _check_file(p, "a vocabulary")
    text = read_utf8(p)
    if p.suffix.lower() != ".json":
        return Vocab.from_text(text).chars
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise GatelensError(f"{p}: not valid JSON ({_one_line(e)})") from None
    if isinstance(obj, dict):
        key = next((k for k in ("chars", "vocab") if k in obj), None)
        if key is None:
            raise GatelensError(f'{p}: a JSON object needs a "chars" or "vocab" list')
        obj = obj[key]
    if not isinstance(obj, list) or not obj:
        raise GatelensError(f"{p}: expected a non-empty JSON list of characters")
    seen: dict[str, int] = {}
    for i, c in enumerate(obj):
        if not isinstance(c, str) or len(c) != 1:
            raise GatelensError(f"{p}: entry {i} is {c!r}, not a single character")
        if c in seen:
            raise GatelensError(f"{p}: character {c!r} appears twice (entries {seen[c]} and {i})")
        seen[c] = i
    return list(obj)
