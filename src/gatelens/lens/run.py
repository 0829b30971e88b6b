"""A run directory opened for analysis: ``gatelens.load_run(RUN)`` is a ``Run``, the explicit
context ``Lens`` takes: the run's model (a CharLM, ``run.model``) and what the run adds to
it (its vocabulary, step-0 baseline, keep gate's starting value, seed and provenance), so
``Lens(load_run(RUN))`` measures it exactly as ``gatelens analyze RUN`` does (that command
is ``Lens`` on this context). Nothing is stored on the module.

>>> import pathlib, tempfile
>>> from gatelens.training.config import TrainConfig
>>> from gatelens.training.train import train
>>> d = tempfile.mkdtemp(); corpus = f"{d}/c.txt"
>>> _ = pathlib.Path(corpus).write_text("abc ab ba cab " * 200)
>>> _ = train(TrainConfig(corpus=corpus, hidden=4, steps=2, seq=16, batch=2, eval_every=2,
...                       val_windows=2, forget_bias=2.0), f"{d}/run", progress=False)
>>> run = load_run(f"{d}/run")
>>> type(run.model).__name__, run.step, round(run.init_keep, 4), run.baseline().step
('CharLM', 2, 0.8808, 0)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gatelens.analysis.settings import DEFAULTS
from gatelens.errors import GatelensError
from gatelens.training.model import CharLM, initial_keep_value
from gatelens.training.runs import checkpoint_steps, history_rows, read_history
from gatelens.training.runs import load_run as load_files

ALL = "all"  # --windows all: every whole window of the text


@dataclass
class Run:
    """A run's model at one checkpoint and what the run adds to it; ``Lens(run)`` takes it."""

    model: CharLM  # eval mode, CPU
    run: Path
    checkpoint: str
    step: int  # the training step of these weights
    config: dict  # config.json
    vocab: list[str]
    _baseline: list = field(default_factory=list, repr=False)

    @property
    def seed(self) -> int:
        """The run's seed: it also draws the perturbation's replacement characters."""
        return int(self.config["train"].get("seed", 0))

    @property
    def init_keep(self) -> float:
        """The keep gate's starting value ("units below init" is read against it)."""
        return initial_keep_value(self.config["train"].get("forget_bias"))

    def baseline(self) -> Run | None:
        """The run's untrained model (its step-0 checkpoint), or None without one."""
        if not self._baseline:
            self._baseline.append(load_run(self.run, 0) if 0 in checkpoint_steps(self.run)
                                  else None)
        return self._baseline[0]

    def model_block(self) -> dict:
        """report.json "model" facts a run adds to its module's."""
        m, tr = self.config["model"], self.config["train"]
        return {"step": self.step, "checkpoint": self.checkpoint,
                "vocab_size": len(self.vocab), "forget_bias": tr.get("forget_bias"),
                "chrono": tr.get("chrono"), "optimizer": tr.get("optimizer", "adam"),
                "bias_init": tr.get("bias_init", "pytorch"),
                "nonlinearity": m.get("nonlinearity", "tanh") if m["cell"] == "rnn" else None}

    def history(self) -> dict | None:
        """Validation (and training) loss over training, from history.csv."""
        return read_history(self.run)

    @property
    def best_step(self) -> int | None:
        return (self.config.get("best") or {}).get("step")

    def facts(self) -> dict:
        """What an ``Analysis`` of this run holds beside the measurements: the loss history,
        the best step and a synthetic corpus's control losses."""
        return {"history": self.history(), "best_step": self.best_step,
                "control": self.control()}

    def control(self) -> dict | None:
        """A synthetic corpus's memoryless and best losses beside the run's best loss."""
        synthetic = self.config.get("corpus", {}).get("synthetic")
        if not synthetic:
            return None
        return {"corpus": synthetic["name"], "memoryless_loss": synthetic["memoryless_loss"],
                "best_loss": synthetic["best_loss"],
                "best_val_loss": (self.config.get("best") or {}).get("val_loss")}

    def windows(self, windows: int | str = DEFAULTS.windows, length: int = DEFAULTS.length,
                text: str | Path | None = None) -> tuple[torch.Tensor, str]:
        """The analysis windows, (B, T) int64, and their source: ``text``'s first windows,
        else windows evenly spaced over the validation split of the run's own corpus
        (``windows="all"``: every whole window, consecutive)."""
        from gatelens.analysis.text import Vocab, analysis_windows, overlap_note, read_text_file
        from gatelens.training.corpus import load_corpus, split

        vocab = Vocab(list(self.vocab))
        if text is not None:
            ids = analysis_windows(vocab, windows, length, text=read_text_file(text),
                                   where=str(text))
            return ids, str(text)
        info = self.config.get("corpus", {})
        name = info.get("name") or self.config["train"]["corpus"]
        sha = info.get("sha256")
        if not sha:  # gatelens always records it: a config.json edited to read another file
            raise GatelensError(f'{self.run / "config.json"}: "corpus.sha256" is missing, so '
                                f"gatelens cannot check that {name} is the text this run was "
                                "trained on (and reads no file unchecked); pass --text FILE")
        if not Path(name).exists() and info.get("source") and Path(info["source"]).exists():
            name = info["source"]  # a relative corpus path, seen from another directory
        corpus = load_corpus(name)
        if hashlib.sha256(corpus.text.encode("utf-8")).hexdigest() != sha:
            raise GatelensError(f"{name}: this corpus has changed since the run was trained "
                                "(sha256 differs); pass --text FILE")
        _, val_text = split(corpus.text)
        ids = analysis_windows(vocab, windows, length, val_text=val_text)
        how = "every whole window" if windows == ALL else f"{windows} windows evenly spaced"
        note = overlap_note(len(val_text), windows, length)
        return ids, f"{name} validation split ({how}{'; ' + note if note else ''})"


def load_run(run: str | Path, checkpoint: str | int = "best", *,
             check_finite: bool = True) -> Run:
    """A run at ``checkpoint`` (best, final or a step): its model (eval mode, CPU) and its
    context (a ``Run``). Weights are safetensors, checked against config.json; NaN/Inf
    weights are refused naming the tensor unless ``check_finite=False``.
    """
    loaded = load_files(run, checkpoint, check_finite=check_finite)
    history_rows(loaded.run)  # history.csv checked before any work (read for the report)
    return Run(loaded.model, loaded.run, str(checkpoint), loaded.step, loaded.config,
               list(loaded.vocab.chars))
