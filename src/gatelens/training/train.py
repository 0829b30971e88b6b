"""The training loop: batches, the optimiser, clipping, evaluation, checkpoints and resume.

A run directory is always valid: every file is written atomically, and at each
evaluation (and on Ctrl-C) the loop saves what an exact resume needs: weights, the
optimiser's state, the RNG states and the step. ``train(..., resume=True)`` continues such a run and
ends with exactly the weights an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import math
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors
import torch
import torch.nn.functional as F

from gatelens._version import version as gatelens_version
from gatelens.analysis.text import Vocab, default_window_starts
from gatelens.errors import CheckFailed, GatelensError
from gatelens.families.registry import recipe
from gatelens.io import atomic_write_json, remove_leftovers
from gatelens.lock import clear_held, is_lock_or_leftover, writing_dir
from gatelens.progress import Progress
from gatelens.stops import STOP_SIGNALS, Stopped, may_take, signal_name
from gatelens.training.checkpoints import (
    HISTORY_FIELDS,
    RESUME,
    _checkpoint,
    _reconcile_best,
    _restore,
    _resume_config,
    _saved_step,
    mark_interrupted,
)
from gatelens.training.config import TrainConfig
from gatelens.training.corpus import load_corpus, split
from gatelens.training.model import (
    CharLM,
    OfficialLM,
    build_lm,
    check_fits,
    set_chrono,
    set_forget_bias,
    zero_biases,
)
from gatelens.training.optim import make_optimizer, optimizer_record
from gatelens.training.runs import (
    CKPT_DIR,
    CONFIG,
    history_rows,
    read_config,
)
from gatelens.training.seed import set_seed

__all__ = ["HISTORY_FIELDS", "RESUME", "Data", "TrainResult", "TrainingDiverged", "build",
           "evaluate", "loss_on", "model_config", "train"]



def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GatelensError("--device cuda: no CUDA device is available")
    return torch.device(name)


@dataclass
class Data:
    """The corpus encoded once: training ids, fixed validation windows, the vocabulary."""

    vocab: Vocab
    train: torch.Tensor  # (N_train,) int64
    val: torch.Tensor  # (n_val_windows, seq + 1) int64
    sha256: str
    name: str
    source: str

    @classmethod
    def load(cls, cfg: TrainConfig, vocab: Vocab | None = None) -> Data:
        corpus = load_corpus(cfg.corpus)
        train_text, val_text = split(corpus.text)
        need = cfg.seq + 1
        if len(train_text) < need:
            raise GatelensError(f"{cfg.corpus}: corpus too short: the training split has "
                                f"{len(train_text)} characters, one window needs {need} "
                                f"(--seq {cfg.seq} + 1)")
        if len(val_text) < need:
            raise GatelensError(f"{cfg.corpus}: corpus too short for the validation set: the "
                                f"last 10 % is {len(val_text)} characters, one window needs "
                                f"{need} (--seq {cfg.seq} + 1)")
        vocab = vocab or Vocab.from_text(corpus.text)
        if vocab.size < 2:
            raise GatelensError(f"{cfg.corpus}: the corpus has one distinct character "
                                f"({vocab.chars[0]!r}); a language model needs at least two")
        val_ids = vocab.encode(val_text, where=cfg.corpus)
        starts = default_window_starts(len(val_text), cfg.val_windows, need)
        val = torch.stack([val_ids[s:s + need] for s in starts])  # (n_val, seq + 1)
        digest = hashlib.sha256(corpus.text.encode("utf-8")).hexdigest()
        return cls(vocab, vocab.encode(train_text, where=cfg.corpus), val, digest,
                   corpus.name, corpus.source)

    def batch(self, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
        """Random windows of seq + 1 characters from the training split, (B, seq + 1)."""
        starts = torch.randint(0, len(self.train) - seq, (batch,), generator=gen)  # (B,)
        return self.train[starts[:, None] + torch.arange(seq + 1)]  # (B, seq + 1)


def _synthetic(name: str) -> dict:
    """config.json's corpus "synthetic" entry (description, exact losses), if it is one."""
    from gatelens.training.synthetic import describe_corpus

    desc = describe_corpus(name)
    return {"synthetic": desc} if desc else {}


def model_config(cfg: TrainConfig) -> dict:
    """config.json's "model" block (less the vocabulary size) for a training config; an
    official implementation's adds its settings and package version ("official")."""
    r = recipe(cfg.cell)
    heads = {"heads": cfg.heads} if r.takes("heads") else {}
    if r.official:
        return {"cell": r.name, "hidden": cfg.hidden, "layers": cfg.layers, "embed": None,
                "nonlinearity": "tanh", "input": "embedding", **heads,
                "official": r.official_block()}
    return {"cell": r.name, "hidden": cfg.hidden, "layers": cfg.layers, "embed": cfg.embed,
            "nonlinearity": cfg.nonlinearity, "input": "embedding" if cfg.embed else "one-hot",
            **heads}


def build(cfg: TrainConfig, vocab_size: int) -> CharLM | OfficialLM:
    """The untrained model for ``cfg``: PyTorch's init from the seed, then ``--bias-init
    zero``, then a forget bias or chrono."""
    set_seed(cfg.seed)
    model = build_lm(model_config(cfg), vocab_size)
    if cfg.bias_init == "zero":
        zero_biases(model)
    if cfg.forget_bias is not None:
        set_forget_bias(model, cfg.forget_bias)
    if cfg.chrono is not None:
        set_chrono(model, cfg.chrono, torch.Generator().manual_seed(cfg.seed))
    return model


def loss_on(model: CharLM, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy of windows ``ids`` (B, T + 1)."""
    logits, _ = model(ids[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: CharLM, val: torch.Tensor, batch: int, device: torch.device) -> float:
    """Validation loss (nats per character) over every validation window."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for k in range(0, len(val), batch):
        ids = val[k:k + batch].to(device)
        total += float(loss_on(model, ids)) * ids.shape[0]
        count += ids.shape[0]
    model.train(was_training)
    return total / count


def _versions() -> dict:
    return {"gatelens": gatelens_version(), "torch": torch.__version__, "numpy": np.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


class _StopFlag:
    """Ctrl-C, SIGTERM or SIGHUP (``stops.STOP_SIGNALS``, those ``stops.may_take``) asks the
    loop to stop at the next step boundary; a second one aborts. ``signum``: the first."""

    def __init__(self) -> None:
        self.stop = False
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():  # else no graceful stop
            self._old = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS
                         if may_take(s)}
        return self

    def _handler(self, signum, frame) -> None:
        if self.stop:
            raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)
        self.stop, self.signum = True, signum

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


@dataclass
class TrainResult:
    run: Path
    steps_done: int
    best_step: int
    best_val_loss: float
    interrupted: bool
    signum: int | None = None  # the signal that stopped it (SIGINT, SIGTERM, SIGHUP)
    steps: int = 0  # the steps it was to train (steps_done of them, if interrupted)

    def stop_line(self) -> str:
        """What to say of an interrupted run: where it stopped, and how to continue it."""
        by = f" ({signal_name(self.signum)})" if self.signum is not None else ""
        return (f"stopped at step {self.steps_done} of {self.steps}{by}; continue with "
                f"`gatelens train --resume --out {self.run}`")


class TrainingDiverged(CheckFailed):
    """The loss, a gradient or the weights stopped being finite: training stops (exit 1),
    keeping the run's last finite checkpoint (config.json's status "diverged")."""


def _prepare_out(out: Path, resume: bool) -> None:
    """Checks made while holding OUT's lock, before anything is written."""
    if resume:
        if not (out / CONFIG).exists():
            raise GatelensError(f"{out}: --resume needs an existing run directory (no {CONFIG})")
        return
    if (out / CONFIG).exists():
        raise GatelensError(f"{out}: holds another run; use --resume to continue it or choose "
                            "another --out")
    # only a lock, or a killed writer's temporary files: an empty directory
    if any(not is_lock_or_leftover(p.name) for p in out.iterdir()):
        raise GatelensError(f"{out}: directory is not empty; choose a new --out")
    remove_leftovers(out)


def train(cfg: TrainConfig | None, out: str | Path, resume: bool = False,
          progress: bool = True, overrides: dict | None = None,
          on_step: Callable[[int], None] | None = None,
          stop_at: int | None = None) -> TrainResult:
    """Train a CharLM and write the run directory ``out``.

    With ``resume=True`` the run's saved settings are used (``cfg`` may be None);
    ``overrides`` are settings given again on resume: they must agree with the run's,
    except ``steps`` (to extend a run, never to shorten it) and ``device``. ``on_step(step)``
    is called after each optimiser step (an exception there is a crash); ``stop_at`` stops
    as Ctrl-C would, after that step. Both are for testing.

    Every setting is checked before anything is written; ``out`` is held with
    ``gatelens.lock`` while training (a second writer is refused). A loss, gradient or
    weight that is not finite stops training with ``TrainingDiverged`` (exit 1): nothing
    is written after the last finite checkpoint.
    """
    if not resume:
        if cfg is None:
            raise ValueError("train() needs a TrainConfig unless resume=True")
        cfg.validate()
    with writing_dir(out) as out:
        try:
            return _train(cfg, out, resume, progress, overrides or {}, on_step, stop_at)
        except KeyboardInterrupt:  # a stop outside the loop's, or a second one: no "running"
            mark_interrupted(out)
            raise


def _finite(model: CharLM) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _train(cfg: TrainConfig | None, out: Path, resume: bool, progress: bool,
           overrides: dict, on_step: Callable[[int], None] | None,
           stop_at: int | None) -> TrainResult:
    _prepare_out(out, resume)
    if resume and not (out / RESUME).exists():  # it died before its first checkpoint
        cfg = _resume_config(read_config(out), overrides, out).validate()
        print(f"gatelens: note: {out}: the run never saved its first state; starting it "
              "over with its settings", file=sys.stderr)
        clear_held(out)
        resume = False
    if resume:
        saved = read_config(out)
        cfg = _resume_config(saved, overrides, out)
        cfg.validate()
        done = _saved_step(out)
        if cfg.steps < done:
            raise GatelensError(f"{out}: --steps {cfg.steps} is below the {done} steps this "
                                "run has done; a run can be extended, not shortened (analyse "
                                "an earlier step with --checkpoint STEP)")
    assert cfg is not None
    device = resolve_device(cfg.device)
    vocab = Vocab(list(saved["vocab"])) if resume else None
    data = Data.load(cfg, vocab)
    if resume and data.sha256 != saved["corpus"]["sha256"]:
        raise GatelensError(f"{out}: the corpus {cfg.corpus} is not the text this run was "
                            "trained on (sha256 differs)")
    check_fits(cfg, model_config(cfg), data.vocab.size)  # before a model too large exists
    model = build(cfg, data.vocab.size).to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)  # batches: saved and restored on resume
    config = {
        "format": "gatelens-run/1",
        "model": {**model_config(cfg), "vocab_size": data.vocab.size},
        "vocab": data.vocab.chars,
        "train": cfg.to_dict(),
        "optimizer": optimizer_record(opt, cfg.clip),
        "corpus": {"name": data.name, "source": data.source, "sha256": data.sha256,
                   "train_chars": len(data.train), "val_windows": len(data.val),
                   "val_fraction": 0.1, **_synthetic(data.name)},
        "versions": _versions(),
        "best": {"step": None, "val_loss": None},
        "steps_done": 0,
        "status": "running",
    }
    step, rows, elapsed = 0, [], 0.0
    if resume:
        remove_leftovers(out)
        remove_leftovers(out / CKPT_DIR)
        step, elapsed = _restore(out, model, opt, gen, saved)
        _reconcile_best(out, saved["best"])
        rows = [r for r in history_rows(out) if int(r["step"]) <= step]
        config["best"], config["status"] = saved["best"], "running"
        config["steps_done"] = step
        config["versions"] = saved.get("versions", config["versions"])
    else:
        val_loss = evaluate(model, data.val, cfg.batch, device)
        if not math.isfinite(val_loss) or not _finite(model):
            raise GatelensError(f"{out}: the untrained model's validation loss is {val_loss}; "
                                "check --forget-bias/--chrono")
        atomic_write_json(out / CONFIG, config)  # first: a directory without it is empty
        (out / CKPT_DIR).mkdir(exist_ok=True)
        rows.append({"step": 0, "train_loss": "", "val_loss": f"{val_loss:.6f}",
                     "seconds": "0.000"})
        _checkpoint(out, model, opt, gen, 0, 0.0, rows, config, val_loss)

    model.train()
    interrupted, diverged = False, None
    bar = Progress(cfg.steps, f"train {cfg.cell} {cfg.hidden}", initial=step, enabled=progress)
    try:
        with _StopFlag() as flag:
            t0 = time.perf_counter() - elapsed
            while step < cfg.steps:
                ids = data.batch(cfg.batch, cfg.seq, gen).to(device)  # (B, seq + 1)
                loss = loss_on(model, ids)
                train_loss = float(loss.detach())
                if not math.isfinite(train_loss):
                    diverged = f"the training loss is {train_loss} at step {step + 1}"
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip))
                if not math.isfinite(norm):
                    diverged = f"the gradient norm is {norm} at step {step + 1}"
                    break
                opt.step()
                step += 1
                row = {"step": step, "train_loss": f"{train_loss:.6f}", "val_loss": "",
                       "seconds": f"{time.perf_counter() - t0:.3f}"}
                rows.append(row)
                bar.update(1, loss=f"{train_loss:.3f}")
                if on_step is not None:
                    on_step(step)
                stopping = flag.stop or step == stop_at
                saving = step % cfg.eval_every == 0 or step == cfg.steps
                if saving or stopping:
                    val_loss = evaluate(model, data.val, cfg.batch, device) if saving else None
                    if val_loss is not None and not math.isfinite(val_loss):
                        diverged = f"the validation loss is {val_loss} at step {step}"
                        break
                    if not _finite(model):
                        diverged = f"the weights hold NaN or Inf after step {step}"
                        break
                    if val_loss is not None:
                        row["val_loss"] = f"{val_loss:.6f}"
                        bar.milestone(f"train loss {train_loss:.3f}, val loss {val_loss:.3f}")
                    # between evaluations (stopping): what an exact resume needs
                    _checkpoint(out, model, opt, gen, step, time.perf_counter() - t0, rows,
                                config, val_loss)
                if stopping:
                    interrupted = True
                    break
    finally:
        bar.close()
    if diverged is not None:
        config["status"], config["diverged"] = "diverged", diverged
        atomic_write_json(out / CONFIG, config)
        raise TrainingDiverged(
            f"{out}: training diverged: {diverged} (--lr {cfg.lr:g}, --optimizer "
            f"{cfg.optimizer}); the run keeps its last finite checkpoint, step "
            f"{config['steps_done']}, and its best step {config['best']['step']}")
    config["status"] = "interrupted" if interrupted and step < cfg.steps else "done"
    atomic_write_json(out / CONFIG, config)
    stopped = interrupted and step < cfg.steps  # the caller says so (cli, reproduce)
    return TrainResult(out, step, config["best"]["step"], config["best"]["val_loss"],
                       stopped, flag.signum if stopped else None, cfg.steps)
