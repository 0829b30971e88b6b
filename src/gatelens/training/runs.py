"""The run directory: config.json, weights, checkpoints, history, and loading them back.

    RUN/config.json          model, vocabulary, every training setting, seed, versions
    RUN/model.safetensors    weights of the best-validation step
    RUN/checkpoints/step-000000.safetensors ...
    RUN/history.csv          step, train_loss, val_loss, seconds
    RUN/resume/              optimiser, RNG and data state of the last checkpoint
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gatelens.errors import GatelensError
from gatelens.io import atomic_write
from gatelens.training.config import TrainConfig
from gatelens.training.corpus import Vocab
from gatelens.training.model import CharLM

CONFIG, WEIGHTS, HISTORY = "config.json", "model.safetensors", "history.csv"
CKPT_DIR = "checkpoints"
_STEP_RE = re.compile(r"^step-(\d{6,})\.safetensors$")


def checkpoint_path(run: Path, step: int) -> Path:
    return Path(run) / CKPT_DIR / f"step-{step:06d}.safetensors"


def checkpoint_steps(run: str | Path) -> list[int]:
    """Steps that have a checkpoint in ``run``, ascending."""
    d = Path(run) / CKPT_DIR
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_RE.match(p.name)))


def save_weights(path: Path, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """Safetensors, written atomically (tensors made contiguous and moved to the CPU)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (meta or {}).items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise GatelensError(f"{path}: not a readable safetensors file ({e})") from None


def history_rows(run: str | Path) -> list[dict[str, str]]:
    """RUN/history.csv as rows of strings (step, train_loss, val_loss, seconds); [] if absent.

    An empty field is a value not taken at that step (val_loss off evaluation steps).
    """
    path = Path(run) / HISTORY
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def read_config(run: str | Path) -> dict:
    path = Path(run) / CONFIG
    if not Path(run).is_dir():
        raise GatelensError(f"{run}: no such run directory")
    if not path.exists():
        raise GatelensError(f"{run}: not a run directory (no {CONFIG})")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        cfg["model"], cfg["vocab"], cfg["train"]  # noqa: B018 - presence check
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GatelensError(f"{path}: not a gatelens config ({e})") from None
    return cfg


@dataclass
class LoadedRun:
    """A model loaded from a run directory, ready for analysis (eval mode, CPU)."""

    run: Path
    model: CharLM
    config: dict  # config.json as written
    vocab: Vocab
    step: int  # the training step these weights are from
    weights: Path  # the file they came from

    @property
    def train_config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.config["train"])


def resolve_checkpoint(run: Path, checkpoint: str | int, cfg: dict) -> tuple[Path, int]:
    """``best`` (model.safetensors), ``final`` (the last checkpoint) or a step number."""
    steps = checkpoint_steps(run)
    if checkpoint == "best":
        path = run / WEIGHTS
        if not path.exists():
            raise GatelensError(f"{run}: missing {WEIGHTS}")
        return path, int(cfg.get("best", {}).get("step", -1))
    if checkpoint == "final":
        if not steps:
            raise GatelensError(f"{run}: no checkpoints in {run / CKPT_DIR}")
        return checkpoint_path(run, steps[-1]), steps[-1]
    try:
        step = int(checkpoint)
    except ValueError:
        raise GatelensError(f"--checkpoint must be best, final or a step number, got "
                            f"{checkpoint!r}") from None
    if step not in steps:
        have = ", ".join(str(s) for s in steps) or "none"
        raise GatelensError(f"{run}: no checkpoint at step {step}; steps available: {have}")
    return checkpoint_path(run, step), step


def load_run(run: str | Path, checkpoint: str | int = "best") -> LoadedRun:
    """Load a run's model from safetensors (never pickle), checked against its config."""
    run = Path(run)
    cfg = read_config(run)
    path, step = resolve_checkpoint(run, checkpoint, cfg)
    model = CharLM.from_config(cfg["model"], len(cfg["vocab"]))
    tensors = read_weights(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise GatelensError(f"{path}: weights do not match {CONFIG} (missing {missing or 'none'},"
                            f" unexpected {extra or 'none'})")
    for name, t in expected.items():
        if tuple(tensors[name].shape) != tuple(t.shape):
            raise GatelensError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, "
                                f"{CONFIG} implies {tuple(t.shape)}")
    model.load_state_dict(tensors)
    model.eval()
    return LoadedRun(run, model, cfg, Vocab(list(cfg["vocab"])), step, path)


def run_windows(loaded: LoadedRun, text: str | Path | None = None, windows: int = 32,
                length: int = 128) -> tuple[torch.Tensor, str]:
    """The analysis windows of docs/methods.md for a run, (B, T) int64, and their source.

    With ``text`` (a file path): its first B consecutive T-character slices. Otherwise B
    windows evenly spaced over the validation split of the run's own corpus.
    """
    from gatelens.training.corpus import analysis_windows, load_corpus, read_text_file, split

    if text is not None:
        ids = analysis_windows(loaded.vocab, windows, length, text=read_text_file(text),
                               where=str(text))
        return ids, str(text)
    info = loaded.config.get("corpus", {})
    name = info.get("name") or loaded.config["train"]["corpus"]
    if not Path(name).exists() and info.get("source") and Path(info["source"]).exists():
        name = info["source"]  # a relative corpus path, seen from another directory
    corpus = load_corpus(name)
    sha = loaded.config.get("corpus", {}).get("sha256")
    if sha and hashlib.sha256(corpus.text.encode("utf-8")).hexdigest() != sha:
        raise GatelensError(f"{name}: this corpus has changed since the run was trained "
                            "(sha256 differs); pass --text FILE")
    _, val_text = split(corpus.text)
    ids = analysis_windows(loaded.vocab, windows, length, val_text=val_text)
    return ids, f"{name} validation split"
