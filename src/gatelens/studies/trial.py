"""One trial of a study: train (or resume, or reuse) its run, then analyse every checkpoint.

    DIR/trials/<id>/run/                    a run directory (every checkpoint kept)
    DIR/trials/<id>/analysis/step-NNNNNN/   ``gatelens analyze`` of each checkpoint
    DIR/trials/<id>/trial.json              status, error, checkpoints [{step, val_loss, report}]

>>> from gatelens.studies.spec import parse_spec
>>> record = new_record(parse_spec({"grid": {"seed": [3]}}).trials[0])
>>> record["id"], record["status"], record["run"]
('seed-3', 'pending', 'trials/seed-3/run')
"""

from __future__ import annotations

import time
from pathlib import Path

from gatelens.errors import GatelensError
from gatelens.io import atomic_write_json, remove_leftovers
from gatelens.lock import clear_held, locked, writing_dir
from gatelens.schema_check import check_fields
from gatelens.studies.spec import STUDY_ANALYSIS, Trial
from gatelens.training.runs import CONFIG, checkpoint_steps, history_rows, read_config

TRIALS = "trials"
#: Seconds a trial waits for the lock of a task that is still dying (a lost node's worker
#: can outlive its raylet a little; its lock is released when it ends).
LOST_HOLDER_WAIT = 120.0


def new_record(trial: Trial) -> dict:
    """trial.json before the trial has run; paths are relative to the study directory."""
    return {"version": 1, "id": trial.id, "condition": trial.condition, "seed": trial.seed,
            "spec": trial.settings(), "run": f"{TRIALS}/{trial.id}/run", "status": "pending",
            "error": None, "how": None, "seconds": None, "timings": {}, "attempts": 1,
            "checkpoints": []}


#: trial.json's keys as the study's readers use them (schema_check's kinds)
RECORD_FIELDS = {"version": ("int",), "id": ("str",), "condition": ("dict",),
                 "seed": ("int",), "spec": ("dict",), "run": ("str",),
                 "status": (("pending", "running", "done", "failed"),),
                 "error": ("str", None), "how": ("str", None), "seconds": ("number", None),
                 "timings": ("dict",), "attempts": ("int",), "checkpoints": ("list",),
                 "copied_from": ("str", None)}
CHECKPOINT_FIELDS = {"step": ("int",), "val_loss": ("number", None)}  # report: path_inside


def check_record(rec: dict, path: object) -> None:
    """A trial.json's keys of the types its readers use (one line naming the file and the
    key, GatelensError); each checkpoint ``{step, val_loss, report}``.

    >>> check_record({"status": "done", "checkpoints": [{"step": "2"}]}, "t/trial.json")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: t/trial.json: "checkpoints[0].step" must be an integer, got '2'
    """
    check_fields(rec, RECORD_FIELDS, path)
    for k, c in enumerate(rec.get("checkpoints") or []):
        if not isinstance(c, dict):
            raise GatelensError(f'{path}: "checkpoints[{k}]" must be an object, got {c!r}')
        check_fields(c, CHECKPOINT_FIELDS, path, f"checkpoints[{k}]",
                     required=("step",) if rec.get("status") == "done" else ())


def _error_line(e: BaseException) -> str:
    """An exception as one line: a GatelensError's own message, else its type and message."""
    text = str(e) if isinstance(e, GatelensError) else f"{type(e).__name__}: {e}"
    return " ".join(text.split()) or type(e).__name__


def run_trial(trial: Trial, out: str | Path, threads: int | None = None,
              attempt: int = 1) -> dict:
    """Train and analyse one trial under ``out``/trials/<id>; write and return trial.json.

    A trial's own failure is recorded (status "failed", the error as one line), never
    raised, so the other trials go on. ``threads`` sets torch's intra-op threads (a Ray
    task's CPUs); ``attempt`` is recorded (a lost task's trial runs again). The trial's
    directory is locked meanwhile; a lock still held by another process is waited for
    (``LOST_HOLDER_WAIT``), then the trial fails naming the holder.
    """
    import torch

    if threads:
        torch.set_num_threads(threads)
    tdir = Path(out) / TRIALS / trial.id
    record, t0 = new_record(trial), time.perf_counter()
    record["attempts"] = attempt
    try:
        with writing_dir(tdir, wait=LOST_HOLDER_WAIT):
            try:
                remove_leftovers(tdir)
                remove_leftovers(tdir / "analysis")  # a killed attempt's half analyses
                record["how"] = _train(trial, tdir / "run")
                record["timings"]["train"] = round(time.perf_counter() - t0, 3)
                record["checkpoints"] = _analyze_all(trial, tdir)
                record["timings"]["analyze"] = round(time.perf_counter() - t0
                                                     - record["timings"]["train"], 3)
                record["status"] = "done"
            except Exception as e:  # a trial's failure is its record, not the study's
                record["status"], record["error"] = "failed", _error_line(e)
            record["seconds"] = round(time.perf_counter() - t0, 3)
            atomic_write_json(tdir / "trial.json", record)
    except GatelensError as e:  # its directory: held by another, or not writable
        record["status"], record["error"] = "failed", _error_line(e)
        record["seconds"] = round(time.perf_counter() - t0, 3)
    return record


def _train(trial: Trial, run: Path) -> str:
    """Train, resume or reuse the trial's run (the trial's lock is held by the caller)."""
    from gatelens.training.train import RESUME, train

    cfg = trial.config()
    if (run / CONFIG).exists() and (run / RESUME).exists():
        saved = read_config(run)
        if saved.get("status") == "done" and saved.get("steps_done") == cfg.steps:
            return "analysed"  # trained before; only analyses were missing
        train(None, run, resume=True, progress=False)
        return "resumed"
    if run.exists():  # a start that died before its first checkpoint: nothing to keep
        with locked(run):  # never while another process writes it
            clear_held(run)
    train(cfg, run, progress=False)
    return "trained"


def _analyze_all(trial: Trial, tdir: Path) -> list[dict]:
    """``analyze`` every checkpoint (step 0 … final) on the condition's windows; PNG plots
    for the final one only (the study plots every figure over training)."""
    from gatelens.lens.analyze import analyze

    run = tdir / "run"
    val = {int(r["step"]): float(r["val_loss"]) for r in history_rows(run) if r["val_loss"]}
    out, steps = [], checkpoint_steps(run)
    for step in steps:
        dest = tdir / "analysis" / f"step-{step:06d}"
        if not (dest / "report.html").exists():  # report.html is written last
            analyze(run, checkpoint=step, out=dest, progress=False, plots=step == steps[-1],
                    **{**STUDY_ANALYSIS, **trial.analysis})
        out.append({"step": step, "val_loss": val.get(step),
                    "report": (dest / "report.json").relative_to(tdir.parent.parent).as_posix()})
    return out
