"""The run directory: config.json, weights, checkpoints, history, and loading them back.

    RUN/config.json          model, vocabulary, every training setting, seed, versions
    RUN/model.safetensors    weights of the best-validation step
    RUN/checkpoints/step-000000.safetensors ...
    RUN/history.csv          step, train_loss, val_loss, seconds
    RUN/resume.safetensors   optimiser, RNG and data state of the last checkpoint

model.safetensors is the authority on the best step: its metadata holds the step its
weights are from (history.csv its validation loss), and ``read_config`` takes "best" from it when
config.json says otherwise (a write that failed between the two files, e.g. a full
disk). Weights holding NaN or Inf are refused by default (``check_finite``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from gatelens.analysis.text import Vocab
from gatelens.errors import GatelensError
from gatelens.io import NO_CAP, SMALL_CAP, atomic_write, check_regular, read_utf8
from gatelens.schema_check import check_chars, check_fields
from gatelens.training.config import TrainConfig
from gatelens.training.model import CharLM, build_lm

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


def _unreadable(path: Path, e: BaseException) -> GatelensError:
    text = " ".join(str(e).split())
    return GatelensError(f"{path}: not a readable safetensors file "
                         f"({text[:117] + '...' if len(text) > 120 else text})")


def _safetensors_call(path: Path, fn):
    """``fn()`` with every failure of the safetensors library (its errors, and the panics of
    its Rust code, which are BaseExceptions) as one GatelensError naming ``path``."""
    check_regular(path, "a safetensors file", NO_CAP)
    try:
        return fn()
    except (SafetensorError, OSError, ValueError, TypeError, RuntimeError) as e:
        raise _unreadable(path, e) from None
    except BaseException as e:
        if type(e).__name__ == "PanicException":
            raise _unreadable(path, e) from None
        raise


def refuse_nonfinite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """GatelensError naming the first tensor holding NaN or Inf.

    >>> nan = float("nan")
    >>> refuse_nonfinite(Path("w.safetensors"), {"a": torch.ones(2), "b": torch.tensor([1, nan])})
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: w.safetensors: tensor b holds NaN or Inf (1 of 2 values); ...
    """
    for name, t in tensors.items():
        if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise GatelensError(f"{path}: tensor {name} holds NaN or Inf ({bad} of {t.numel()} "
                                "values); these weights cannot be used")


def read_weights(path: Path, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (CPU). Anything unreadable, and (unless
    ``check_finite=False``) a tensor holding NaN or Inf, is a one-line GatelensError."""
    path = Path(path)
    tensors = _safetensors_call(path, lambda: load_file(str(path)))
    if check_finite:
        refuse_nonfinite(path, tensors)
    return tensors


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's metadata (its header only; {} if it has none)."""
    path = Path(path)

    def meta() -> dict[str, str]:
        with safe_open(str(path), "pt") as fh:
            return dict(fh.metadata() or {})
    return _safetensors_call(path, meta)


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors header, without reading the data."""
    path = Path(path)

    def shapes() -> dict[str, tuple[int, ...]]:
        with safe_open(str(path), "pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    return _safetensors_call(path, shapes)


#: The largest history.csv read (a row a step, ~30 bytes: some 8 million steps).
HISTORY_CAP = 256 * 1024**2
#: history.csv's columns: step an integer, the others numbers or empty (not taken then)
_HISTORY_KINDS = {"step": int, "train_loss": float, "val_loss": float, "seconds": float}


def history_rows(run: str | Path) -> list[dict[str, str]]:
    """RUN/history.csv as rows of strings (step, train_loss, val_loss, seconds); [] if absent.

    An empty field is a value not taken at that step (val_loss off evaluation steps). The
    file is checked before use (a regular UTF-8 file under ``HISTORY_CAP``, each row's step
    an integer and its losses numbers or empty): anything else is one line naming the file,
    the row and the column.
    """
    path = Path(run) / HISTORY
    if not os.path.lexists(path):
        return []
    text = read_utf8(path, "a gatelens history.csv", HISTORY_CAP)
    try:
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise GatelensError(f"{path}: not a gatelens history.csv ({e})") from None
    for k, row in enumerate(rows, start=2):  # line 1 is the header
        for col, kind in _HISTORY_KINDS.items():
            value = row.get(col)
            if value is None and col in ("step", "val_loss"):
                raise GatelensError(f'{path}: line {k} has no "{col}"')
            try:
                if value:
                    kind(value)  # a float may be nan: a diverged run's last loss
            except ValueError:
                raise GatelensError(f'{path}: line {k}: "{col}" must be '
                                    f'{"an integer" if kind is int else "a number"}, '
                                    f"got {value[:40]!r}") from None
    return rows


def read_config(run: str | Path) -> dict:
    """RUN/config.json, checked (model block, vocabulary, settings); "best" as
    model.safetensors's own metadata says (module docstring)."""
    path = Path(run) / CONFIG
    if not Path(run).is_dir():
        raise GatelensError(f"{run}: no such run directory")
    if not path.exists():
        raise GatelensError(f"{run}: not a run directory (no {CONFIG})")
    try:
        cfg = json.loads(read_utf8(path, "a gatelens config", SMALL_CAP))
    except (json.JSONDecodeError, RecursionError) as e:
        raise GatelensError(f"{path}: not a gatelens config ({type(e).__name__})") from None
    _check_config(cfg, path)
    _best_from_weights(Path(run), cfg)
    return cfg


def _check_config(cfg: object, path: Path) -> None:
    """What loading a run relies on: GatelensError naming the first thing amiss."""
    def bad(what: str) -> GatelensError:
        return GatelensError(f"{path}: not a gatelens config ({what})")

    if not isinstance(cfg, dict):
        raise bad("not a JSON object")
    for key, kind in (("model", dict), ("vocab", list), ("train", dict)):
        if not isinstance(cfg.get(key), kind):
            raise bad(f'"{key}" missing or not a {kind.__name__}')
    m, vocab = cfg["model"], cfg["vocab"]
    try:
        check_chars(vocab, '"vocab"')
    except GatelensError as e:
        raise bad(str(e)) from None
    if "vocab_size" in m and m["vocab_size"] != len(vocab):
        raise bad(f'"model" vocab_size {m["vocab_size"]!r} is not the {len(vocab)} characters '
                  'of "vocab"')
    fields = {"cell": m.get("cell"), "hidden": m.get("hidden"), "layers": m.get("layers"),
              "embed": m.get("embed"), "nonlinearity": m.get("nonlinearity", "tanh"),
              "heads": m.get("heads", 1)}
    try:
        TrainConfig(**fields).validate()
    except (GatelensError, TypeError) as e:
        raise bad(f'"model": {e}') from None
    best = cfg.get("best", {"step": None})
    if not isinstance(best, dict) or not isinstance(best.get("step"), int | None):
        raise bad('"best" must be {"step", "val_loss"}')
    _check_blocks(cfg, path)


#: config.json's blocks besides "model" and "vocab", as the readers use them
_TOP = {"corpus": ("dict",), "steps_done": ("int",), "status": ("str",),
        "optimizer": ("dict",), "versions": ("dict",), "format": ("str",)}
_TRAIN = {**{k: ("int",) for k in ("hidden", "layers", "heads", "steps", "batch", "seq",
                                    "eval_every", "val_windows", "seed")},
          **{k: ("str",) for k in ("corpus", "cell", "nonlinearity", "optimizer",
                                    "bias_init", "device")},
          "embed": ("int", None), "lr": ("number",), "clip": ("number",),
          "forget_bias": ("number", None), "chrono": ("number", None)}
_CORPUS = {"name": ("str",), "source": ("str",), "sha256": ("str",), "synthetic": ("dict",),
           "train_chars": ("int",), "val_windows": ("int",)}


def _check_blocks(cfg: dict, path: Path) -> None:
    """The types of every key a reader of config.json uses (schema_check), then the
    training settings' own rules (``TrainConfig.validate``), each one line naming the key."""
    check_fields(cfg, _TOP, path)
    check_fields(cfg["train"], _TRAIN, path, "train")
    check_fields(cfg.get("corpus", {}), _CORPUS, path, "corpus")
    check_fields(cfg["best"] if isinstance(cfg.get("best"), dict) else {},
                 {"val_loss": ("number", None)}, path, "best")
    try:
        TrainConfig.from_dict(cfg["train"]).validate()
    except GatelensError as e:  # "--seed must be ..." -> "train.seed" must be ...
        msg = re.sub(r"^--([a-z-]+)", lambda g: f'"train.{g[1].replace("-", "_")}"', str(e))
        raise GatelensError(f"{path}: {msg}") from None


def _best_from_weights(run: Path, cfg: dict) -> None:
    """Set cfg["best"] from model.safetensors's metadata where the two disagree."""
    path = run / WEIGHTS
    if not path.is_file():
        return
    try:
        meta = read_metadata(path)
        step = int(meta["step"])
    except (GatelensError, KeyError, ValueError):
        return  # loading it will say what is wrong
    best = cfg.get("best") or {}
    if best.get("step") == step:
        return
    try:  # train writes history.csv before the weights of a step
        val = next((round(float(r["val_loss"]), 6) for r in history_rows(run)
                    if r.get("step") == str(step) and r.get("val_loss")), None)
    except (GatelensError, ValueError, TypeError, OSError):  # a broken history.csv: said
        val = None  # by whatever reads it next
    cfg["best"] = {"step": step, "val_loss": val}


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
    if checkpoint == "best":  # the step model.safetensors says of itself (read_config)
        path = run / WEIGHTS
        if not path.exists():
            raise GatelensError(f"{run}: missing {WEIGHTS}")
        step = (cfg.get("best") or {}).get("step")
        return path, -1 if step is None else int(step)
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


def load_run(run: str | Path, checkpoint: str | int = "best", *,
             check_finite: bool = True) -> LoadedRun:
    """Load a run's model from safetensors (never pickle), checked against its config.

    The tensor names and shapes are checked against config.json from the file's header
    before any weight is read. Weights holding NaN or Inf are a GatelensError naming the
    tensor unless ``check_finite=False`` (to inspect a run that went wrong).
    """
    run = Path(run)
    cfg = read_config(run)
    path, step = resolve_checkpoint(run, checkpoint, cfg)
    try:
        with torch.device("meta"):  # the shapes config.json implies, without memory
            expected = {k: tuple(v.shape) for k, v in
                        build_lm(cfg["model"], len(cfg["vocab"])).state_dict().items()}
    except (ValueError, TypeError, RuntimeError, KeyError) as e:
        why = " ".join(str(e).split())
        raise GatelensError(f"{run / CONFIG}: not a model gatelens can build "
                            f"({why[:157] + '...' if len(why) > 160 else why})") from None
    shapes = read_shapes(path)
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        raise GatelensError(f"{path}: weights do not match {CONFIG} (missing {missing or 'none'},"
                            f" unexpected {extra or 'none'})")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise GatelensError(f"{path}: {name} has shape {shapes[name]}, "
                                f"{CONFIG} implies {shape}")
    tensors = read_weights(path, check_finite=check_finite)
    model = build_lm(cfg["model"], len(cfg["vocab"]))
    try:
        model.load_state_dict(tensors)
    except RuntimeError as e:  # e.g. a dtype PyTorch cannot copy from
        raise GatelensError(f"{path}: weights do not load into the model "
                            f"({' '.join(str(e).split())[:160]})") from None
    model.eval()
    return LoadedRun(run, model, cfg, Vocab(list(cfg["vocab"])), step, path)


def read_history(run: Path) -> dict | None:
    """Validation loss over training from RUN/history.csv (rows with a val_loss), or None.

    Returns {"step": [...], "val_loss": [...], "train_step": [...], "train_loss": [...]}.
    """
    out: dict[str, list] = {"step": [], "val_loss": [], "train_step": [], "train_loss": []}
    for row in history_rows(run):
        try:
            step = int(row["step"])
            if row.get("val_loss"):
                out["step"].append(step)
                out["val_loss"].append(float(row["val_loss"]))
            if row.get("train_loss"):
                out["train_step"].append(step)
                out["train_loss"].append(float(row["train_loss"]))
        except (KeyError, ValueError):  # history_rows refused malformed rows already
            continue
    return out if out["step"] or out["train_step"] else None
