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

from gatelens.analysis.text import Vocab
from gatelens.errors import GatelensError
from gatelens.io import NO_CAP, check_regular, read_utf8
from gatelens.schema_check import check_chars
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


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
TORCHSCRIPT = ("{p}: a TorchScript archive (torch.jit.save), which gatelens never loads: loading "
               "one runs its code. Export the weights from a Python you trust with it: "
               "torch.save(torch.jit.load(FILE).state_dict(), 'weights.pt')")


def _onnx_like(head: bytes) -> bool:
    """ModelProto's first field: ir_version (tag 0x08, a small varint), then another field
    of ModelProto (producer_name 0x12 … graph 0x3a, opset_import 0x42, ...)."""
    return (len(head) >= 3 and head[0] == 0x08 and 1 <= head[1] <= 30
            and head[2] in (0x12, 0x1a, 0x22, 0x28, 0x32, 0x3a, 0x42, 0x4a, 0x72, 0x7a))


def sniff(path: PathLike) -> str:
    """A weights file's format from its first bytes, never from unpickling it:
    "safetensors", "torch" (a torch.save zip, or the legacy pickle that torch.load reads
    with weights_only=True), "torchscript", "keras" (a .keras zip), "hdf5", "onnx", or
    "unknown".

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "weights"
    >>> torch.save({"w": torch.zeros(2)}, p)
    >>> sniff(p)
    'torch'
    """
    import zipfile

    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(16)
        starts = []
        for off in (0, 512, 1024, 2048):  # HDF5 may sit after a user block
            f.seek(off)
            starts.append(f.read(8))
    if HDF5_SIGNATURE in starts:
        return "hdf5"
    if zipfile.is_zipfile(p):
        try:
            with zipfile.ZipFile(p) as z:
                names = z.namelist()
        except zipfile.BadZipFile:
            return "unknown"
        if any(n.endswith("constants.pkl") or "/code/" in n for n in names):
            return "torchscript"
        if "config.json" in names and "model.weights.h5" in names:
            return "keras"
        return "torch" if any(n.endswith("data.pkl") for n in names) else "unknown"
    if len(head) >= 9:
        n = int.from_bytes(head[:8], "little")
        if 0 < n <= p.stat().st_size - 8 and head[8:9] == b"{":
            return "safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "torch"
    return "onnx" if _onnx_like(head) else "unknown"


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
    if suffix and suffix not in SUFFIXES:
        raise GatelensError(f"{p}: unknown weights format {suffix!r}; "
                            f"gatelens reads {', '.join(SUFFIXES)}, .onnx, .h5, .keras")
    _check_file(p, "a weights file", NO_CAP)
    kind = sniff(p)
    if kind == "torchscript":
        raise GatelensError(TORCHSCRIPT.format(p=p))
    if not suffix:  # no extension: what the first bytes say
        if kind not in ("safetensors", "torch"):
            raise GatelensError(f"{p}: no extension, and its first bytes are not those of a "
                                f"safetensors or torch.save file ({kind})")
        suffix = ".safetensors" if kind == "safetensors" else ".pt"
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
    return check_chars(obj, str(p))


def extend_vocab(chars: list[str], rows: int, what: str) -> tuple[list[str], list[str]]:
    """A vocabulary shorter than the model's input (an embedding's rows, or a one-hot
    width): the extra indices are named ``<unused k>`` (k the row) and a note says so.

    >>> extend_vocab(list("ab"), 4, "embedding 'emb.weight'")[0]
    ['a', 'b', '<unused 2>', '<unused 3>']
    """
    if rows <= len(chars):
        return list(chars), []
    extra = [f"<unused {k}>" for k in range(len(chars), rows)]
    note = (f"the vocabulary has {len(chars)} characters but {what} has {rows} rows: rows "
            f"{len(chars)}..{rows - 1} are named {extra[0]}" + (f" … {extra[-1]}" if
                                                                 len(extra) > 1 else "")
            + " and never occur in the text (a padding or reserved row)")
    return list(chars) + extra, [note]
