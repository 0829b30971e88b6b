"""What a run saves at each checkpoint and reads back on resume (training/train.py's loop).

    RUN/history.csv          step, train_loss, val_loss, seconds (written first)
    RUN/checkpoints/step-NNNNNN.safetensors, RUN/model.safetensors (its metadata: its step)
    RUN/resume.safetensors   weights, the optimiser's state, the RNG states (read last)
    RUN/config.json          steps_done, best
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import torch

from gatelens.errors import GatelensError
from gatelens.families.registry import canonical
from gatelens.io import atomic_write_json, atomic_write_text
from gatelens.training.config import TrainConfig
from gatelens.training.model import CharLM
from gatelens.training.optim import load_state, state_tensors
from gatelens.training.runs import (
    CONFIG,
    HISTORY,
    WEIGHTS,
    checkpoint_path,
    read_metadata,
    read_weights,
    save_weights,
)

RESUME = "resume.safetensors"  # weights + optimiser state + RNG states of the last saved step
HISTORY_FIELDS = ("step", "train_loss", "val_loss", "seconds")


def _write_history(run: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=HISTORY_FIELDS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(run / HISTORY, buf.getvalue())


def _checkpoint(out: Path, model: CharLM, opt: torch.optim.Optimizer, gen: torch.Generator,
                step: int, seconds: float, rows: list[dict], config: dict,
                val_loss: float | None) -> None:
    """Persist one step. Order matters for crash safety: history.csv first, so the loss of
    any step whose weights are on disk is in it; a resume reads resume.safetensors last,
    so everything it points at is already on disk; and model.safetensors's metadata
    carries its own step, which readers trust over config.json (``runs.read_config``).
    (One metadata key: safetensors writes several in no fixed order, and a run's files
    are bit-identical from run to run.)"""
    weights = model.state_dict()
    _write_history(out, rows)
    if val_loss is not None:
        save_weights(checkpoint_path(out, step), weights, {"step": step})
        best = config["best"]["val_loss"]
        if best is None or val_loss < best:
            save_weights(out / WEIGHTS, weights, {"step": step})
            config["best"] = {"step": step, "val_loss": round(val_loss, 6)}
    state = {f"model.{k}": v for k, v in weights.items()}
    opt_state, nones = state_tensors(opt)
    state.update(opt_state)
    state["rng.torch"] = torch.get_rng_state()
    state["rng.batches"] = gen.get_state()
    save_weights(out / RESUME, state, {"step": step, "seconds": repr(seconds),
                                       "best": json.dumps(config["best"]),
                                       "optimizer": type(opt).__name__, "opt_none": nones})
    config["steps_done"] = step
    atomic_write_json(out / CONFIG, config)


def _saved_step(out: Path) -> int:
    """The step resume.safetensors holds (what a resume continues from)."""
    path = out / RESUME
    if not path.exists():
        raise GatelensError(f"{out}: cannot resume, {RESUME} is missing")
    try:
        return int(read_metadata(path)["step"])
    except (KeyError, ValueError):
        raise GatelensError(f"{path}: no step in its metadata; not a gatelens resume "
                            "file") from None


def _restore(out: Path, model: CharLM, opt: torch.optim.Optimizer, gen: torch.Generator,
             saved: dict) -> tuple[int, float]:
    path = out / RESUME
    meta = read_metadata(path)
    state = read_weights(path)
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()
                           if k.startswith("model.")})
    load_state(opt, state, meta.get("opt_none"))
    torch.set_rng_state(state["rng.torch"])
    gen.set_state(state["rng.batches"])
    saved["best"] = json.loads(meta.get("best", json.dumps(saved["best"])))
    return int(meta["step"]), float(meta.get("seconds", "0"))


def _reconcile_best(out: Path, best: dict) -> None:
    """Make model.safetensors the weights of ``best`` (the resumed state's best step): a run
    killed between writing a new best and its resume state left a best from a step the
    resume will train again."""
    step = best.get("step")
    if step is None or not (out / WEIGHTS).exists():
        return
    try:
        have = int(read_metadata(out / WEIGHTS).get("step", -1))
    except (GatelensError, ValueError):
        have = None
    if have == step:
        return
    save_weights(out / WEIGHTS, read_weights(checkpoint_path(out, step)), {"step": step})


def _resume_config(saved: dict, overrides: dict, out: Path) -> TrainConfig:
    """The run's saved config with ``overrides`` applied; only steps and device may differ."""
    cfg = TrainConfig.from_dict(saved["train"])
    for name, value in overrides.items():
        if name in ("steps", "device"):
            setattr(cfg, name, value)
        elif name == "cell" and canonical(value) == canonical(cfg.cell):
            continue  # an earlier --cell name of the same family
        elif value != getattr(cfg, name):
            raise GatelensError(f"{out}: --{name.replace('_', '-')} {value} differs from the "
                                f"run's {getattr(cfg, name)}; a resumed run keeps its settings")
    return cfg


def mark_interrupted(out: Path) -> None:
    """OUT/config.json, if written and still "running", says "interrupted": a stop that
    came outside the training loop's own (its steps_done and best are the last
    checkpoint's, where --resume continues). An unreadable one is left as it is."""
    try:
        config = json.loads((out / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(config, dict) and config.get("status") == "running":
        atomic_write_json(out / CONFIG, {**config, "status": "interrupted"})
