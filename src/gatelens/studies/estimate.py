"""What a study will cost before it starts: wall time (training and the analysis of every
checkpoint) and disk, measured on one trial and scaled to the others.

``measure_trial`` trains the first trial's model for 3 steps in a temporary directory and
analyses its checkpoint (once to warm up, then timed without plots, as a study analyses
every checkpoint but the last, and with them, as it analyses the last), counting the bytes
written. It takes a few seconds (the plots alone about 4 s on a 2-core machine). Cells
differ in speed far more than parameter counts say (xlstm's sLSTM steps in Python, 4-8x
an nn.LSTM of its size), so the first trial of every other cell in the study is measured
too (``measure_trial(full=False)``: its 3 steps and one analysis, no warm-up, no plots).
``estimate`` scales those figures to every trial to run, each from its own cell's:
training time by parameter count × (batch · seq) × steps, analysis time by parameter count
× (windows · length), bytes of weights by parameter count, bytes of an analysis by units ×
(windows · length) (the final checkpoint's plots, time and bytes, as measured on the first
trial), and packs trials onto the workers in order (``makespan``). An estimate, not a
promise: one cell at other sizes, and another machine, differ.

>>> makespan([10, 10, 10], 2), makespan([10, 10, 10, 10], 2), makespan([5], 4)
(20.0, 20.0, 5.0)
>>> duration(75), duration(3725), duration(2 * 86400 + 3600)
('1:15', '1:02:05', '2 d 1:00:00')
>>> size(3.2e9), size(12e6), size(660e3)
('3.2 GB', '12 MB', '660 kB')
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gatelens.studies.spec import STUDY_ANALYSIS, Trial
from gatelens.training.config import TrainConfig


def makespan(seconds: list[float], workers: int) -> float:
    """Wall time of jobs taken in order, each by the first free of ``workers``."""
    free = [0.0] * max(1, workers)
    for s in seconds:
        k = free.index(min(free))
        free[k] += s
    return max(free)


def duration(seconds: float) -> str:
    """Seconds as m:ss, h:mm:ss or 'D d h:mm:ss'; '?' when unknown."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    clock = f"{h}:{s // 60:02d}:{s % 60:02d}" if h or d else f"{s // 60}:{s % 60:02d}"
    return f"{d} d {clock}" if d else clock


def size(n: float) -> str:
    """Bytes in decimal units, 2 significant figures (or whole units from 100 on)."""
    for unit, k in (("TB", 12), ("GB", 9), ("MB", 6), ("kB", 3)):
        if n >= 10**k:
            v = n / 10**k
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.2g} {unit}"
    return f"{int(n)} bytes"


def step_seconds(trial: Trial, threads: int = 1, steps: int = 3) -> float:
    """Seconds per training step of ``trial``'s model, timed in-process (one warm-up step,
    then ``steps``) with ``threads`` torch threads."""
    import torch

    from gatelens.training.optim import make_optimizer
    from gatelens.training.train import Data, build, loss_on

    cfg = trial.config()
    data = Data.load(cfg)
    model = build(cfg, data.vocab.size)
    opt = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in range(steps + 1):
            if k == 1:
                t0 = time.perf_counter()
            loss = loss_on(model, data.batch(cfg.batch, cfg.seq, gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return (time.perf_counter() - t0) / steps
    finally:
        torch.set_num_threads(old)


def _bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


@dataclass
class TrialCost:
    """One trial's measured costs (``measure_trial``)."""

    trial: Trial
    step_s: float  # one optimiser step
    eval_s: float  # one evaluation + checkpoint (validation loss, weights written)
    setup_s: float  # corpus, model, first files
    analysis_s: float  # ``analyze`` of one checkpoint, no plots
    plots_s: float  # the extra seconds of the final checkpoint's plots
    checkpoint_bytes: int  # one checkpoint file (model.safetensors is the same size)
    resume_bytes: int
    analysis_bytes: int  # one analysis without plots
    plots_bytes: int  # the plots of the final one


def checkpoints_of(train: dict) -> int:
    """Checkpoints a trial's run keeps: step 0, every eval_every, and the last step.

    >>> checkpoints_of({"steps": 800, "eval_every": 100})
    9
    >>> checkpoints_of({"steps": 10, "eval_every": 4})  # 0, 4, 8, 10
    4
    """
    steps, every = train["steps"], train["eval_every"]
    return 1 + steps // every + (1 if steps % every else 0)


def measure_trial(trial: Trial, threads: int = 1, full: bool = True) -> TrialCost:
    """Time and weigh ``trial``'s model on 3 training steps and its analyses (module doc);
    ``full=False``: one analysis, no warm-up and no plots (``plots_s``, ``plots_bytes`` 0)."""
    import torch

    from gatelens.lens.analyze import analyze
    from gatelens.training.train import CKPT_DIR, RESUME, train

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    d = Path(tempfile.mkdtemp(prefix="gatelens-estimate-"))
    try:
        step_s = step_seconds(trial, threads)
        cfg = TrainConfig.from_dict({**trial.train, "steps": 3, "eval_every": 3})
        t0 = time.perf_counter()
        train(cfg, d / "run", progress=False)
        t_train = time.perf_counter() - t0
        settings = {**STUDY_ANALYSIS, **trial.analysis}
        if full:  # a warm-up first: a study's worker pays the imports once, not per checkpoint
            analyze(d / "run", checkpoint=3, out=d / "w", progress=False, plots=False,
                    **settings)
        t0 = time.perf_counter()
        analyze(d / "run", checkpoint=3, out=d / "a", progress=False, plots=False, **settings)
        t_analysis = t_plots = time.perf_counter() - t0
        if full:
            t0 = time.perf_counter()
            analyze(d / "run", checkpoint=3, out=d / "p", progress=False, plots=True,
                    **settings)
            t_plots = time.perf_counter() - t0
        # train's 3 steps, 2 evaluations (steps 0 and 3), the rest is setting up
        eval_s = max(0.0, (t_train - 3 * step_s) / 3)
        return TrialCost(
            trial, step_s, eval_s, setup_s=eval_s, analysis_s=t_analysis,
            plots_s=max(0.0, t_plots - t_analysis),
            checkpoint_bytes=(d / "run" / CKPT_DIR / "step-000000.safetensors").stat().st_size,
            resume_bytes=(d / "run" / RESUME).stat().st_size,
            analysis_bytes=_bytes(d / "a"),
            plots_bytes=max(0, _bytes(d / "p") - _bytes(d / "a")) if full else 0)
    finally:
        torch.set_num_threads(old)
        shutil.rmtree(d, ignore_errors=True)


_PARAMS: dict[str, int] = {}


def _params(train: dict) -> int:
    """Parameters of a trial's model (cached: a grid repeats few models many times)."""
    from gatelens.studies.spec import vocab_size
    from gatelens.training.model import parameter_count
    from gatelens.training.train import model_config

    model = model_config(TrainConfig.from_dict(train))
    key = json.dumps([model, train["corpus"]], sort_keys=True)
    if key not in _PARAMS:
        _PARAMS[key] = parameter_count(model, vocab_size(train["corpus"]))
    return _PARAMS[key]


@dataclass
class Estimate:
    """What ``estimate`` found: wall time, its parts, disk."""

    seconds: float  # wall time on the workers
    train_s: float  # total over trials (CPU seconds, before packing onto workers)
    analysis_s: float
    bytes: float
    per_trial_bytes: float
    cost: TrialCost  # the first trial's
    cells: int = 1  # cells measured, one trial each

    def line(self, workers: int, free: int | None = None) -> str:
        c = self.cost
        n = checkpoints_of(c.trial.train)
        more = (f"; {self.cells - 1} other cells measured on a trial each"
                if self.cells > 1 else "")
        text = (f"about {duration(self.seconds)} on {workers} worker"
                f"{'' if workers == 1 else 's'} (training "
                f"{duration(self.train_s)}, analyses {duration(self.analysis_s)} of worker "
                f"time; {c.trial.id}: {c.step_s * 1e3:.1f} ms a step, {c.analysis_s:.2f} s "
                f"an analysis x {n} checkpoints{more}) and about {size(self.bytes)} on disk "
                f"({size(self.per_trial_bytes)} a trial)")
        if free is not None and self.bytes > free:
            text += f"; WARNING: only {size(free)} free there"
        return text


def cell_of(trial: Trial) -> str:
    """What ``estimate`` measures once: the trial's cell (a study's costs differ most by it)."""
    return str(trial.train["cell"])


def estimate(todo: list[Trial], workers: int, cost: TrialCost,
             cells: dict[str, TrialCost] | None = None) -> Estimate:
    """Scale the measured costs to every trial of ``todo`` (module doc): each trial from
    ``cells[cell_of(trial)]`` where given, else from ``cost`` (the first trial's, whose plots
    every trial's final checkpoint pays)."""
    cells = {cell_of(cost.trial): cost, **(cells or {})}
    times, train_total, ana_total, total_bytes = [], 0.0, 0.0, 0.0
    for t in todo:
        own = cells.get(cell_of(t), cost)
        base = own.trial
        p0 = _params(base.train)
        tokens0 = base.train["batch"] * base.train["seq"]
        win0 = base.analysis["windows"] * base.analysis["length"]
        units0 = base.train["hidden"] * base.train["layers"]
        p = _params(t.train)
        r_train = p / p0 * (t.train["batch"] * t.train["seq"]) / tokens0
        r_ana = p / p0 * (t.analysis["windows"] * t.analysis["length"]) / win0
        r_bytes = (t.train["hidden"] * t.train["layers"]) / units0 * (
            t.analysis["windows"] * t.analysis["length"]) / win0
        n = checkpoints_of(t.train)
        train_s = (t.train["steps"] * own.step_s * r_train
                   + n * own.eval_s * r_train * t.train["val_windows"] / base.train["val_windows"]
                   + own.setup_s)
        ana_s = n * own.analysis_s * r_ana + cost.plots_s  # plotting: about fixed
        weights = (n + 1) * own.checkpoint_bytes * p / p0 + own.resume_bytes * p / p0
        analyses = n * own.analysis_bytes * r_bytes + cost.plots_bytes
        times.append(train_s + ana_s)
        train_total += train_s
        ana_total += ana_s
        total_bytes += weights + analyses + 40 * t.train["steps"]  # history.csv rows
    return Estimate(makespan(times, workers), train_total, ana_total, total_bytes,
                    total_bytes / max(1, len(todo)), cost, len(cells))
