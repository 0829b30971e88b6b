"""``gatelens reproduce``: the seed's experiment end to end, our figures beside the seed's.

Trains the seed's LSTM (325 units, 800 steps, TrainConfig defaults) and, as the seed's series
compared them, a GRU and an RNN on the default corpus; analyses all three with the seed's
window sizes; writes OUT/reproduce.md and OUT/reproduce.json. The seed's figures and the comparison
live in ``seed_compare``, their Markdown in ``report.reproduce_md``. Resumable: a finished sub-run
is reused, an interrupted one resumed, an analysis already written re-run (it is cheap).

    OUT/runs/{lstm,gru,rnn}/       run directories (gatelens train)
    OUT/analysis/{lstm,gru,rnn}/   report.json, report.md, plots
    OUT/reproduce.md, OUT/reproduce.json

>>> SEED_CELLS, DEFAULT_SIZES["lstm"], sorted(DEFAULT_SIZES)[:3]
(('lstm', 'gru', 'rnn'), {'hidden': 325, 'steps': 800}, ['gru', 'lstm', 'mingru'])
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from gatelens.analysis.settings import DEFAULTS
from gatelens.errors import GatelensError
from gatelens.io import atomic_write_many
from gatelens.lens.analyze import analyze
from gatelens.lock import is_lock_or_leftover, writing_dir
from gatelens.report.reproduce_md import render_reproduce
from gatelens.stops import Stopped
from gatelens.studies.seed_compare import CELLS, SEED_FIGURES, compare, forget_bias_study
from gatelens.training.config import TrainConfig
from gatelens.training.runs import history_rows, read_config

#: Training sizes per cell (TrainConfig overrides). The LSTM is the seed's; GRU and RNN get
#: the same 325 units and 800 steps so the series compares like with like. On 2 idle CPU
#: cores one step costs about 0.13 s (LSTM), 0.05 s (GRU), 0.02 s (RNN), so the three fit in
#: the 6-minute budget; reproduce.md records the measured training seconds of each run.
#: `--cells` adds gatelens's other cells (seed_compare.CELLS) at the same units and steps,
#: so the series differs only in the cell.
DEFAULT_SIZES: dict[str, dict] = {c: {"hidden": 325, "steps": 800} for c in CELLS}
#: The cells `gatelens reproduce` trains unless told otherwise (the seed's series).
SEED_CELLS = ("lstm", "gru", "rnn")
_CHECKED = ("corpus", "cell", "hidden", "layers", "steps", "batch", "seq", "seed", "lr",
            "forget_bias", "chrono")
FORGET_BIAS_RUN = "lstm-forget-bias"  # the optional fourth run of `reproduce --forget-bias B`

__all__ = ["DEFAULT_SIZES", "reproduce"]


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens reproduce: {msg}", file=sys.stderr)


def _stop_if_interrupted(result) -> None:
    """Ctrl-C (or SIGTERM, SIGHUP) inside train() ends training cleanly; reproduce stops
    there too, with one line saying where (the exit code 128 + the signal)."""
    if getattr(result, "interrupted", False):
        signum = getattr(result, "signum", None) or signal.SIGINT
        raise Stopped(signum, f"{result.run.name} stopped at step {result.steps_done} of "
                              f"{result.steps}; rerun the same `gatelens reproduce` command "
                              "to continue")


def ensure_run(cfg: TrainConfig, run: Path, progress: bool = True) -> str:
    """Train ``run`` unless it is already complete; resume it if interrupted or shorter.

    Returns "reused", "resumed" or "trained". A run made with other settings (steps aside:
    a shorter run is extended) is an error, never silently mixed in.
    """
    from gatelens.training.train import (
        train,  # imported late: training pulls in tqdm and the data code
    )

    if (run / "config.json").exists():
        saved = read_config(run)
        mismatch = [k for k in _CHECKED if k != "steps" and saved["train"].get(k) != getattr(
            cfg, k)]
        if saved["train"].get("steps", 0) > cfg.steps:
            mismatch.append("steps")
        if mismatch:
            raise GatelensError(f"{run}: holds a run with other settings ({', '.join(mismatch)});"
                                " choose another --out")
        if saved.get("status") == "done" and saved.get("steps_done", 0) >= cfg.steps:
            return "reused"
        _stop_if_interrupted(train(None, run, resume=True, progress=progress,
                                   overrides={"steps": cfg.steps}))
        return "resumed"
    if run.exists() and any(not is_lock_or_leftover(p.name) for p in run.iterdir()):
        raise GatelensError(f"{run}: not a run directory but not empty; remove it or choose "
                            "another --out")
    _stop_if_interrupted(train(cfg, run, progress=progress))
    return "trained"


def _history_seconds(run: Path) -> float | None:
    """Training wall time recorded in history.csv (its last row's seconds)."""
    rows = history_rows(run)
    try:
        return float(rows[-1]["seconds"])
    except (IndexError, KeyError, ValueError):
        return None


def reproduce(out: str | Path, *, corpus: str = "shakespeare",
              sizes: dict[str, dict] | None = None, windows: int = DEFAULTS.windows,
              length: int = DEFAULTS.length, perturb_pos: int = DEFAULTS.perturb_pos,
              progress: bool = True,
              forget_bias: float | None = None, cells: tuple[str, ...] | None = None,
              seeds: int = 1) -> dict:
    """Train (or reuse), analyse and compare the three cells; returns reproduce.json's content.

    ``seeds`` > 1 trains every cell again with seeds 1 … N − 1 (runs/<cell>-seed<k>) and
    adds the spread over seeds (mean, sample sd, min, max, n) of each series figure; the
    comparison with the seed's figures stays that of seed 0.
    ``cells`` chooses the cells (default the seed's LSTM, GRU and RNN; any of lstm, gru,
    rnn, mingru, minlstm, slstm) at their :data:`DEFAULT_SIZES`.
    ``sizes`` maps a cell to TrainConfig overrides (it overrides ``cells``); tests
    pass a tiny corpus and tiny sizes. ``forget_bias`` adds the seed's forget-bias study: a
    fourth LSTM, the same as the first but with that total forget bias, set beside it.
    OUT is checked before any work and held with ``gatelens.lock`` throughout.
    """
    with writing_dir(out) as out:
        return _reproduce(out, corpus, sizes, windows, length, perturb_pos, progress,
                          forget_bias, cells, seeds)


def _reproduce(out: Path, corpus: str, sizes: dict[str, dict] | None, windows: int,
               length: int, perturb_pos: int, progress: bool, forget_bias: float | None,
               cells: tuple[str, ...] | None, seeds: int) -> dict:
    if sizes is None:
        sizes = {c: DEFAULT_SIZES[c] for c in (cells or SEED_CELLS) if c in DEFAULT_SIZES}
        unknown = sorted(set(cells or ()) - set(DEFAULT_SIZES))
        if unknown:
            raise GatelensError(f"reproduce: unknown cells {unknown}; expected some of "
                                f"{', '.join(DEFAULT_SIZES)}")
    unknown = sorted(set(sizes) - set(CELLS))
    if unknown:
        raise GatelensError(f"reproduce: unknown cells {unknown}; expected {list(CELLS)}")
    runs: dict[str, dict] = {}
    reports: dict[str, dict] = {}
    for cell in (c for c in CELLS if c in sizes):
        cfg = TrainConfig(corpus=corpus, cell=cell, **sizes[cell]).validate()
        run = out / "runs" / cell
        _say(progress, f"{cell}: {cfg.hidden} units, {cfg.steps} steps -> {run}")
        t0 = time.perf_counter()
        how = ensure_run(cfg, run, progress)
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        a = analyze(run, windows=windows, length=length, perturb_pos=perturb_pos,
                    out=out / "analysis" / cell, progress=progress)
        t_analyze = time.perf_counter() - t0
        saved = read_config(run)
        reports[cell] = a.report
        runs[cell] = {
            "run": str(run), "report": str(a.out / "report.json"), "how": how,
            "config": {k: getattr(cfg, k) for k in ("hidden", "layers", "steps", "batch", "seq",
                                                    "lr", "seed", "forget_bias", "chrono")},
            "best": saved.get("best"), "steps_done": saved.get("steps_done"),
            "train_seconds_recorded": _history_seconds(run),
            "seconds_this_call": {"train": round(t_train, 2), "analyze": round(t_analyze, 2)},
        }
    study = None
    if forget_bias is not None:
        if "lstm" not in sizes:
            raise GatelensError("reproduce: --forget-bias compares with the LSTM; train it too")
        cfg = TrainConfig(corpus=corpus, cell="lstm", forget_bias=forget_bias,
                          **sizes["lstm"]).validate()
        run = out / "runs" / FORGET_BIAS_RUN
        _say(progress, f"lstm with forget bias {forget_bias}: {cfg.hidden} units, "
                       f"{cfg.steps} steps -> {run}")
        how = ensure_run(cfg, run, progress)
        a = analyze(run, windows=windows, length=length, perturb_pos=perturb_pos,
                    out=out / "analysis" / FORGET_BIAS_RUN, progress=progress)
        study = forget_bias_study(forget_bias, reports["lstm"], a.report,
                                  runs["lstm"]["best"], read_config(run).get("best"), how)
    spread = None
    if seeds > 1:
        spread = _spread(out, corpus, sizes, seeds, reports, runs, windows, length, perturb_pos,
                         progress)
    result = {"version": 1, "corpus": corpus, "windows": windows, "length": length,
              "perturb_pos": perturb_pos, "seed": SEED_FIGURES, "runs": runs,
              **compare(reports, runs), "forget_bias": study, "seeds": seeds,
              "spread": spread}
    text = json.dumps(result, indent=2, allow_nan=False) + "\n"
    md = render_reproduce(result)
    atomic_write_many({out / "reproduce.json": lambda t: t.write_text(text, encoding="utf-8"),
                       out / "reproduce.md": lambda t: t.write_text(md, encoding="utf-8")})
    _say(progress, f"wrote {out / 'reproduce.md'} and reproduce.json")
    return result


def _spread(out: Path, corpus: str, sizes: dict[str, dict], seeds: int,
            reports: dict[str, dict], runs: dict[str, dict], windows: int, length: int,
            perturb_pos: int, progress: bool) -> dict:
    """Each cell's series figures over seeds 0 … seeds − 1: mean, sample sd, min, max, n."""
    from gatelens.studies.merge import report_figures, summarize

    spread: dict[str, dict] = {}
    for cell in (c for c in CELLS if c in sizes):
        figs = [{**report_figures(reports[cell]),
                 "best_val_loss": (runs[cell].get("best") or {}).get("val_loss")}]
        for k in range(1, seeds):
            cfg = TrainConfig(corpus=corpus, cell=cell, **{**sizes[cell], "seed": k}).validate()
            run = out / "runs" / f"{cell}-seed{k}"
            _say(progress, f"{cell}, seed {k}: {cfg.hidden} units, {cfg.steps} steps -> {run}")
            ensure_run(cfg, run, progress)
            a = analyze(run, windows=windows, length=length, perturb_pos=perturb_pos,
                        out=out / "analysis" / f"{cell}-seed{k}", progress=progress)
            figs.append({**report_figures(a.report),
                         "best_val_loss": (read_config(run).get("best") or {}).get("val_loss")})
        names = [n for n in figs[0] if all(n in f and f[n] is not None for f in figs)]
        spread[cell] = {n: {**summarize([float(f[n]) for f in figs]), "n": len(figs)}
                        for n in names}
    return spread
