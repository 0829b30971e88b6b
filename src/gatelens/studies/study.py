"""``gatelens study``: many training runs, each analysed at every checkpoint, as Ray tasks.

    DIR/trials/<id>/run/                    a run directory (every checkpoint kept)
    DIR/trials/<id>/analysis/step-NNNNNN/   ``gatelens analyze`` of each checkpoint (plots:
                                            the final one's only)
    DIR/trials/<id>/trial.json              status, error, checkpoints [{step, val_loss, report}]
    DIR/study.json  DIR/study.md  DIR/study.html   the merge (``gatelens.studies.merge``)

A trial is a Ray task (one CPU, ``torch.set_num_threads`` to match). A finished trial whose
trial.json records the same settings is reused without training; an interrupted one is
resumed (``train(..., resume=True)``, analyses already written are kept); a failing one is
recorded with its error while the others go on. Ray is imported only when trials run.

One writer per directory (``gatelens.lock``): the study holds DIR, each trial (a Ray task,
wherever it runs) holds DIR/trials/<id>, and ``train`` the run inside it. A trial whose
task was lost with its worker or node (Ray reports it as a system error, not the trial's
own) is submitted again, up to ``MAX_ATTEMPTS`` times in all; the new attempt takes over
the dead task's stale lock and resumes its run from the last checkpoint.

>>> record = new_record(parse_spec({"grid": {"seed": [3]}}).trials[0])
>>> record["id"], record["status"], record["run"]
('seed-3', 'pending', 'trials/seed-3/run')
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gatelens.errors import GatelensError
from gatelens.io import SMALL_CAP, atomic_write_json, path_inside, read_utf8
from gatelens.lock import is_lock_or_leftover, writing_dir
from gatelens.progress import Progress
from gatelens.stops import kept_handlers
from gatelens.studies.estimate import cell_of, estimate, makespan, measure_trial, step_seconds
from gatelens.studies.spec import (
    StudySpec,
    Trial,
    check_corpora,
    check_sizes,
    corpora_outside,
    load_preset,
    load_spec,
    normal_settings,
    parse_spec,
)
from gatelens.studies.trial import (
    LOST_HOLDER_WAIT,
    TRIALS,
    _error_line,
    check_record,
    new_record,
    run_trial,
)

__all__ = ["LOST_HOLDER_WAIT", "TRIALS", "StudyResult", "load_preset", "load_spec", "makespan",
           "new_record", "parse_spec", "run_study", "run_trial", "seed_by_seed", "step_seconds"]

#: Attempts a trial gets when its Ray task is lost (worker or node died), in all.
MAX_ATTEMPTS = 3
INSTALL_HINT = "gatelens study needs Ray: install the extra with pip install 'gatelens[study]'"


def plan(spec: StudySpec, out: Path,
         reuse: Iterable[str | Path] = ()) -> tuple[list[dict], list[Trial]]:
    """Finished trials to reuse (their trial.json) and trials to run. A trial directory
    holding other settings is an error: the study would mix two experiments. A trial not
    finished here whose settings equal a finished trial of a study in ``reuse`` is copied
    from there (``copy_trial``) and reused."""
    done_elsewhere = _finished_trials(reuse)
    reused, todo = [], []
    for trial in spec.trials:
        path = out / TRIALS / trial.id / "trial.json"
        rec = _read_record(path)
        if rec is not None and normal_settings(rec.get("spec")) != trial.settings():
            raise GatelensError(f"{path}: this trial was run with other settings than "
                                f"{spec.where} gives; choose another --out")
        if rec is not None and rec.get("status") == "done":
            reused.append({**rec, "how": "reused"})
            continue
        src = done_elsewhere.get(_settings_key(trial.settings()))
        if src is not None and rec is None and not (out / TRIALS / trial.id).exists():
            reused.append(copy_trial(src, trial, out))
        else:
            todo.append(trial)
    return reused, seed_by_seed(todo)


def seed_by_seed(trials: list[Trial]) -> list[Trial]:
    """``trials`` in the order a study runs them: every condition at its first seed, then
    every condition at the next, each seed's conditions in the grid's order. A study
    stopped early then holds every condition at fewer seeds, not some at none.

    >>> from gatelens.studies.spec import parse_spec
    >>> spec = parse_spec({"grid": {"cell": ["lstm", "gru"], "seed": [0, 1]}})
    >>> [t.id for t in spec.trials]
    ['cell-lstm_seed-0', 'cell-lstm_seed-1', 'cell-gru_seed-0', 'cell-gru_seed-1']
    >>> [t.id for t in seed_by_seed(spec.trials)]
    ['cell-lstm_seed-0', 'cell-gru_seed-0', 'cell-lstm_seed-1', 'cell-gru_seed-1']
    """
    rank = {s: k for k, s in enumerate(dict.fromkeys(t.seed for t in trials))}
    return sorted(trials, key=lambda t: rank[t.seed])


def _settings_key(settings: object) -> str:
    return json.dumps(normal_settings(settings), sort_keys=True)


def _finished_trials(dirs: Iterable[str | Path]) -> dict[str, Path]:
    """Settings -> trial directory, over the finished trials of other studies' DIRs."""
    found: dict[str, Path] = {}
    for d in dirs:
        d = Path(d)
        if not (d / TRIALS).is_dir():
            raise GatelensError(f"--reuse {d}: not a study directory (no {TRIALS}/ in it)")
        for path in sorted((d / TRIALS).glob("*/trial.json")):
            if path.parent.name.startswith("."):  # a copy under way or interrupted
                continue
            try:
                rec = _read_record(path)
            except GatelensError as e:  # another study's record: say which flag led there
                raise GatelensError(f"--reuse {e}") from None
            if rec and rec.get("status") == "done" and isinstance(rec.get("spec"), dict):
                found.setdefault(_settings_key(rec["spec"]), path.parent)
    return found


def copy_trial(src: Path, trial: Trial, out: Path) -> dict:
    """Copy a finished trial of another study (same settings) into ``out`` as ``trial``:
    its run and analyses as they are, its trial.json with this study's id, condition and
    paths, ``how`` "copied" and ``copied_from`` the source directory. Atomic: a copy
    interrupted half-way leaves no trial directory. Nothing outside ``src`` is read: a
    report path of its trial.json leading out is a GatelensError, a symbolic link is not
    copied."""
    rec = _read_record(src / "trial.json") or {}
    old = f"{TRIALS}/{src.name}/"
    if not isinstance(rec.get("checkpoints"), list):
        raise GatelensError(f"--reuse {src / 'trial.json'}: checkpoints is not a list")
    for k, c in enumerate(rec["checkpoints"]):  # never followed out of the trial
        rel, where = (c.get("report") if isinstance(c, dict) else None,
                      f"--reuse {src / 'trial.json'}: checkpoints[{k}].report")
        if not (isinstance(rel, str) and rel.startswith(old)):
            raise GatelensError(f"{where} {rel!r} is not a path inside {src}")
        path_inside(src, rel.removeprefix(old), where)
    dest = out / TRIALS / trial.id
    tmp = out / TRIALS / f".{trial.id}.copying"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    for part in ("run", "analysis"):
        if (src / part).exists():  # not the other study's locks or temporary files
            shutil.copytree(src / part, tmp / part, ignore=lambda d, names: [
                n for n in names if is_lock_or_leftover(n) or os.path.islink(Path(d, n))])
    new = {**new_record(trial), **{k: rec.get(k) for k in ("status", "error", "seconds",
                                                           "timings")},
           "how": "copied", "copied_from": str(src.resolve()),
           "checkpoints": [{**c, "report": f"{TRIALS}/{trial.id}/"
                            + c["report"].removeprefix(old)} for c in rec["checkpoints"]]}
    atomic_write_json(tmp / "trial.json", new)
    tmp.rename(dest)
    return new


def _reused_words(reused: list[dict]) -> str:
    """'N finished, reused' and, when some were, 'K of them copied from --reuse'."""
    copied = sum(r.get("how") == "copied" for r in reused)
    return f"{len(reused)} finished, reused" + (f", {copied} of them copied from --reuse"
                                                 if copied else "")


def _read_record(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        rec = json.loads(read_utf8(path, "a trial record", SMALL_CAP))
    except (json.JSONDecodeError, RecursionError) as e:
        raise GatelensError(f"{path}: not a trial record ({type(e).__name__})") from None
    if not isinstance(rec, dict):
        raise GatelensError(f"{path}: not a trial record (not a JSON object)")
    check_record(rec, path)
    return rec


def _estimate(todo: list[Trial], workers: int, out: Path) -> str:
    """One line: wall time (training and analyses) and disk, measured on the first trial of
    each cell (``gatelens.studies.estimate``), and a warning when the disk has less free."""
    cells: dict = {}
    for t in todo:  # the first trial of each cell (estimate's module doc)
        if cell_of(t) not in cells:
            try:
                cells[cell_of(t)] = measure_trial(t, full=not cells)
            except GatelensError as e:
                return f"no estimate ({t.id}: {e})"
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = None
    return estimate(todo, workers, cells[cell_of(todo[0])], cells).line(workers, free)


def _import_ray():
    try:
        with warnings.catch_warnings():  # only Ray's own import-time deprecations
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray(\..*)?")
            import ray
    except ImportError:
        raise GatelensError(INSTALL_HINT) from None
    return ray


@contextmanager
def ray_session(workers: int | None = None, address: str | None = None) -> Iterator[Any]:
    """Ray, initialised: an already running one as it is (left running), else a local Ray
    with ``workers`` CPUs (default: all cores) or the cluster at ``address``, shut down
    after."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        # warnings: only Ray's own deprecations, only while it starts; kept_handlers:
        # ray.init's SIGTERM handlers (one exits without unwinding, a C one prints a stack
        # dump) undone, so SIGTERM stops a study as Ctrl-C does
        with warnings.catch_warnings(), kept_handlers():
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray(\..*)?")
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"ray(\..*)?")
            kw = {"logging_level": logging.WARNING, "log_to_driver": False}
            if address:
                try:
                    ray.init(address=address, **kw)
                except Exception as e:  # unreachable, refused, or a token it did not accept
                    why = _error_line(e)[:160]
                    raise GatelensError(
                        f"--address {address}: could not join the Ray cluster ({why}"
                        "); a cluster that `ray start` began with token authentication needs "
                        "RAY_AUTH_MODE=token and its token (~/.ray/auth_token) here") from None
            else:
                # "local": a new Ray of our own, even where `ray start` left a cluster (which
                # ray.init() with no address would join)
                ray.init(address="local", num_cpus=workers or os.cpu_count(),
                         include_dashboard=False, **kw)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def run_ray(todo: list[Trial], out: Path, *, workers: int | None = None,
            address: str | None = None, cpus_per_trial: int = 1,
            progress: bool = True) -> list[dict]:
    """Run ``todo`` as Ray tasks (``ray_session``) and return their records in completion
    order. With ``workers`` at most that many trials are in flight."""
    out = out.resolve()
    with ray_session(workers, address) as ray:
        task = ray.remote(num_cpus=cpus_per_trial, max_retries=0)(run_trial)
        final = (ray.exceptions.RayTaskError, ray.exceptions.TaskCancelledError)
        limit = workers or len(todo)
        queue, pending, records = [(t, 1) for t in todo], {}, []
        bar = Progress(len(todo), "study", unit="trial", enabled=progress)
        while queue or pending:
            while queue and len(pending) < limit:
                t, attempt = queue.pop(0)
                pending[task.remote(t, str(out), cpus_per_trial, attempt)] = (t, attempt)
            done, _ = ray.wait(list(pending), num_returns=1)
            t, attempt = pending.pop(done[0])
            try:
                rec = ray.get(done[0])
            except ray.exceptions.RayError as e:  # the task died (worker or node lost, OOM)
                if not isinstance(e, final) and attempt < MAX_ATTEMPTS:
                    print(f"gatelens study: {t.id}: its task was lost ({_error_line(e)[:120]});"
                          f" submitting it again (attempt {attempt + 1} of {MAX_ATTEMPTS})",
                          file=sys.stderr)
                    queue.insert(0, (t, attempt + 1))
                    continue
                rec = {**new_record(t), "status": "failed", "error": _error_line(e),
                       "attempts": attempt}
                atomic_write_json(out / TRIALS / t.id / "trial.json", rec)
            records.append(rec)
            bar.update(1)
            bar.milestone(f"{t.id} {rec['status']}")
        bar.close()
    return records


@dataclass
class StudyResult:
    """What ``run_study`` did: study.json's content and the counts of trials."""

    out: Path
    study: dict  # study.json
    ran: int
    reused: int
    failed: int


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens study: {msg}", file=sys.stderr)


def run_study(spec: StudySpec | str | Path, out: str | Path, *, workers: int | None = None,
              address: str | None = None, progress: bool = True,
              reuse: Iterable[str | Path] = ()) -> StudyResult:
    """Run every trial of ``spec`` (a StudySpec or a SPEC.toml path) that is not finished,
    then merge all into ``out``/study.json, study.md and study.html. A trial whose
    settings equal a finished trial of a study directory in ``reuse`` is copied, not run.

    Everything is checked before any work; bad input raises a one-line GatelensError.
    """
    if not isinstance(spec, StudySpec):
        spec = load_spec(spec)
    with writing_dir(out) as out:
        return _run_study(spec, out, workers, address, progress, reuse)


def _run_study(spec: StudySpec, out: Path, workers: int | None, address: str | None,
               progress: bool, reuse: Iterable[str | Path]) -> StudyResult:
    from gatelens.studies.merge import write_study

    reused, todo = plan(spec, out, reuse)
    records: list[dict] = list(reused)
    if todo:
        check_corpora(todo)  # before Ray and before any work
        check_sizes(todo)
        _import_ray()  # a missing Ray is a one-line error
        if workers:  # more workers than trials to run have nothing to do (and Ray takes at
            workers = min(workers, len(todo))  # most 1e14 CPUs: --workers 2**62 failed)
        workers_n = workers or (os.cpu_count() or 1)
        outside = corpora_outside(spec, todo)
        note = (f"; corpus {', '.join(outside)} is outside {Path(spec.where).parent}/ (its "
                "windows are published in every report)") if outside else ""
        if progress:
            _say(progress, f"{len(spec.trials)} trials ({_reused_words(reused)}; "
                           f"{len(todo)} to run); " + _estimate(todo, workers_n, out) + note)
        elif note:
            print(f"gatelens study: note: {note[2:]}", file=sys.stderr)
        (out / TRIALS).mkdir(parents=True, exist_ok=True)
        records += run_ray(todo, out, workers=workers, address=address, progress=progress)
    else:
        _say(progress, f"{len(spec.trials)} trials, all finished ({_reused_words(reused)}); "
                       "merging")
    order = {t.id: k for k, t in enumerate(spec.trials)}
    records.sort(key=lambda r: order[r["id"]])
    study = write_study(spec, records, out)
    failed = sum(r["status"] != "done" for r in records)
    _say(progress, f"wrote {out / 'study.json'}, study.md, study.html ({failed} failed)")
    return StudyResult(out, study, len(todo), len(reused), failed)


def failed_lines(records: Iterable[dict]) -> list[str]:
    """One line per failed trial: its id and error.

    >>> failed_lines([{"id": "a", "status": "failed", "error": "x.txt: no such file"}])
    ['a: x.txt: no such file']
    """
    return [f"{r['id']}: {r['error']}" for r in records if r["status"] != "done"]
