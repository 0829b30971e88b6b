"""A local Hugging Face model directory, opened offline: ``gatelens.load_hf(DIR)`` and
``gatelens analyze --model DIR``.

The directory is what ``save_pretrained`` writes: ``config.json``, the weights as
safetensors (``model.safetensors``, or shards with ``model.safetensors.index.json``) and,
for text, the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json`` ...). It is
opened with transformers' own ``from_pretrained`` and ``local_files_only=True``: nothing is
downloaded, and the code that runs is the installed transformers' own, never the
directory's (``trust_remote_code`` only when asked for). The model class is the one
config.json's ``architectures`` names, else the model_type's causal LM, else its base model.

Refused, each in one line naming the directory (GatelensError, exit 2 on the command line):
no such directory, no or unreadable config.json, a model_type the installed transformers
does not know (unless ``trust_remote_code``), weights only as pickles (``*.bin``, ``*.pt``,
``*.pth``, ``*.ckpt``: never unpickled; convert them to safetensors), no weights at all, a
weights file that lacks tensors the model needs (they would be left random), and a model
with no recurrent module gatelens opens.

>>> load_hf("/no/such/dir")
Traceback (most recent call last):
...
gatelens.errors.GatelensError: /no/such/dir: no such directory (a Hugging Face model ...
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.errors import GatelensError

#: weights files that are pickles: never opened
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
#: files any of which means the directory holds a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model",
                   "vocab.txt", "spiece.model")
_WHAT = "a Hugging Face model directory: config.json, *.safetensors, tokenizer files"


@dataclass(frozen=True)
class HFModel:
    """A local Hugging Face checkpoint, opened: ``model, tokenizer = load_hf(DIR)`` unpacks.

    Attributes:
        model: the transformers model, in eval mode (its own dtype, as saved).
        tokenizer: the directory's tokenizer (transformers' own class), None when the
            directory has no tokenizer files.
        directory: where it was read from.
        model_type: config.json's ``model_type``.
        notes: what a reader of the report must know (tensors in the file the model did not
            use).
    """

    model: nn.Module
    tokenizer: Any | None
    directory: Path
    model_type: str
    notes: tuple[str, ...] = field(default=())

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer))

    @property
    def vocab_size(self) -> int:
        """The rows of the model's input embedding: the ids it reads are 0 … V − 1."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def encode(self, text: str) -> Tensor:
        """The token ids of ``text`` (1-D int64), as the tokenizer gives them, no special
        tokens added; an id the model's embedding has no row for is a one-line error."""
        if self.tokenizer is None:
            files = ", ".join(TOKENIZER_FILES)
            raise GatelensError(f"{self.directory}: no tokenizer files ({files}); text "
                                "cannot be turned into the model's tokens")
        ids = torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"],
                           dtype=torch.long)
        if ids.numel() and int(ids.max()) >= self.vocab_size:
            raise GatelensError(f"{self.directory}: the tokenizer gives id {int(ids.max())}, but "
                                f"the model's embedding has {self.vocab_size} rows")
        return ids

    def tokens(self) -> list[str]:
        """Each id's text in id order, one per embedding row (``<k>`` for an id the
        tokenizer has no text for, or every id when there is no tokenizer)."""
        V, tok = self.vocab_size, self.tokenizer
        n = 0 if tok is None else min(len(tok), V)
        out = [tok.decode([i]) for i in range(n)] if n else []
        out = [s if s else f"<{i}>" for i, s in enumerate(out)]
        return out + [f"<{i}>" for i in range(n, V)]

    def windows(self, text: str, windows: int | str, length: int,
                where: str = "text") -> Tensor:
        """The first ``windows`` consecutive, non-overlapping ``length``-token windows of
        ``text`` (B, T) int64; ``"all"``: every whole one (``token_windows``)."""
        return token_windows(self.encode(text), windows, length, where)

    def describe(self) -> str:
        """One line: the directory, the class, the size and the tokenizer."""
        n = sum(p.numel() for p in self.model.parameters())
        tok = "no tokenizer" if self.tokenizer is None else \
            f"tokenizer {type(self.tokenizer).__name__} of {len(self.tokenizer)} tokens"
        dtype = next(self.model.parameters()).dtype
        return (f"{self.directory}: {type(self.model).__name__} (model_type "
                f"{self.model_type}), {n:,} parameters, {dtype}, vocabulary {self.vocab_size}; "
                f"{tok}")



def add_model_dir_arguments(parser: Any, model_help: str, modules_help: str | None = None
                            ) -> None:
    """``--model DIR``, ``--trust-remote-code`` and (with ``modules_help``) ``--modules LIST``
    in one group of ``parser`` (``gatelens analyze``, ``verify``, ``patch``), each command
    saying what it does with DIR.

    >>> import argparse
    >>> p = argparse.ArgumentParser(); add_model_dir_arguments(p, "a checkpoint", "which")
    >>> a = p.parse_args(["--model", "ckpt", "--modules", "0,-1"])
    >>> a.model, a.modules, a.trust_remote_code
    ('ckpt', [0, -1], False)
    """
    from gatelens.readout.select import layer_list

    g = parser.add_argument_group(
        "a Hugging Face model directory",
        "config.json, *.safetensors and tokenizer files (save_pretrained), opened offline")
    g.add_argument("--model", metavar="DIR", help=model_help)
    if modules_help is not None:
        g.add_argument("--modules", metavar="LIST", type=layer_list, default=None,
                       help=modules_help)
    g.add_argument("--trust-remote-code", action="store_true", dest="trust_remote_code",
                   help="let transformers run the directory's own Python code (auto_map): "
                        "only for a directory you trust (default: never)")


def token_windows(ids: Tensor, windows: int | str, length: int, where: str = "text") -> Tensor:
    """The first ``windows`` consecutive ``length``-long slices of ``ids`` (N,), as (B, T);
    ``"all"``: every whole one; too few ids is a one-line error naming ``where``.

    >>> token_windows(torch.arange(7), "all", 3).tolist()
    [[0, 1, 2], [3, 4, 5]]
    >>> token_windows(torch.arange(7), 3, 3, "a.txt")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: a.txt: 7 tokens, too few for 3 windows of 3 tokens (needs 9)
    """
    n = len(ids)
    if windows == "all":
        if n < length:
            raise GatelensError(f"{where}: {n} tokens, not one window of {length} tokens")
        windows = n // length
    if not isinstance(windows, int) or windows <= 0 or length <= 0:
        raise GatelensError(f"windows and length must be positive (got {windows}, {length})")
    if n < windows * length:
        raise GatelensError(f"{where}: {n} tokens, too few for {windows} windows of {length} "
                            f"tokens (needs {windows * length})")
    return ids[: windows * length].view(windows, length)


def _config(d: Path) -> dict:
    path = d / "config.json"
    if not path.is_file():
        raise GatelensError(f"{d}: no config.json ({_WHAT})")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GatelensError(f"{path}: not JSON ({e})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise GatelensError(f"{path}: no \"model_type\" (what save_pretrained writes names it)")
    return cfg


def _check_weights(d: Path) -> None:
    if any(d.glob("*.safetensors")):
        return
    pickles = sorted(p.name for pat in PICKLES for p in d.glob(pat))
    if pickles:
        raise GatelensError(f"{d}: the weights are pickles only ({', '.join(pickles)}); gatelens "
                            "never unpickles a file: save them as safetensors "
                            "(model.save_pretrained(DIR) writes model.safetensors)")
    raise GatelensError(f"{d}: no weights (*.safetensors) ({_WHAT})")


def _quiet() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _model_class(config: Any, trust_remote_code: bool) -> Any:
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if isinstance(cls, type) and issubclass(cls, nn.Module) and not trust_remote_code:
        return cls
    causal = transformers.AutoModelForCausalLM
    known = type(config) in causal._model_mapping or (
        trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}))
    return causal if known else transformers.AutoModel


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def load_hf(directory: str | os.PathLike, *, trust_remote_code: bool = False) -> HFModel:
    """Open a local Hugging Face model directory (module docstring), offline.

    Returns an :class:`HFModel` (``model, tokenizer = load_hf(DIR)`` also works); the model
    is in eval mode. ``trust_remote_code=True`` lets transformers run the directory's own
    Python code (config.json's ``auto_map``): only for a directory you trust.
    """
    d = Path(directory)
    if not d.is_dir():
        raise GatelensError(f"{d}: no such directory ({_WHAT})")
    raw = _config(d)
    _check_weights(d)
    try:
        import transformers
    except ImportError:
        raise GatelensError(f"{d}: opening a Hugging Face directory needs the transformers "
                            "package: pip install 'gatelens[modern]'") from None
    _quiet()
    mt = raw["model_type"]
    if mt not in transformers.CONFIG_MAPPING and not trust_remote_code:
        raise GatelensError(f"{d}/config.json: model_type {mt!r} is not one transformers "
                            f"{transformers.__version__} knows (its own code in the directory "
                            "runs only with --trust-remote-code)")
    common = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    overrides, changed = _config_overrides(raw)
    try:
        config = transformers.AutoConfig.from_pretrained(d, **common, **overrides)
        cls = _model_class(config, trust_remote_code)
        kw = common if cls.__name__.startswith("Auto") else {"local_files_only": True}
        model, info = cls.from_pretrained(d, config=config, use_safetensors=True,
                                          output_loading_info=True, **kw)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, ImportError) as e:
        raise GatelensError(f"{d}: transformers could not load the model "
                            f"({type(e).__name__}: {_one_line(e)})") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise GatelensError(f"{d}: the weights lack {len(missing)} tensor(s) "
                            f"{type(model).__name__} needs (first {missing[0]!r}); they would be "
                            "left random")
    unused = sorted(info.get("unexpected_keys") or [])
    notes = ((f"{len(unused)} tensor(s) in the weights were not used by "
              f"{type(model).__name__} (first {unused[0]!r})",) if unused else ()) + changed
    _check_opened(model, d)
    return HFModel(model.eval(), _tokenizer(d, trust_remote_code), d, mt, notes)


def _config_overrides(raw: dict) -> tuple[dict, tuple[str, ...]]:
    """config.json settings a family changes so the model runs here (a family's
    ``hf_config_overrides(raw)`` -> (settings, note), e.g. xLSTM's Triton kernels for the
    native ones), and the notes saying so."""
    from gatelens.families.registry import family_classes

    settings: dict = {}
    notes: list[str] = []
    for cls in family_classes():
        hook = getattr(cls, "hf_config_overrides", None)
        got = hook(raw) if hook is not None else None
        if got:
            settings.update(got[0])
            notes.append(got[1])
    return settings, tuple(notes)


def _check_opened(model: nn.Module, d: Path) -> None:
    from gatelens.families.registry import family_of
    from gatelens.families.unopened import nothing_opened

    if not any(family_of(m) is not None for m in model.modules()):
        raise GatelensError(f"{d}: {nothing_opened(model)}")


def _tokenizer(d: Path, trust_remote_code: bool) -> Any | None:
    if not any((d / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(d, local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, ImportError) as e:
        raise GatelensError(f"{d}: transformers could not load the tokenizer "
                            f"({type(e).__name__}: {_one_line(e)})") from None
