"""``gatelens analyze``: from a run directory to report.json, report.md and plots.

Orchestration only: load the run, build the windows, trace the trained, perturbed and
untrained models, call one pure function per measurement (``gatelens.analysis``), and write
the report (``gatelens.report``). Every number is defined in METHODS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .analysis import (
    char_classes,
    decompose,
    gate_distributions,
    perturb_windows,
    perturbation_decay,
    unit_timescales,
    verification,
)
from .errors import GatelensError
from .io import atomic_write_text
from .model import initial_keep_value
from .report.html import HtmlReport, write_html
from .report.json_report import build_report, read_history, write_report_json
from .report.markdown import render_markdown
from .report.plots import write_plots
from .runs import checkpoint_steps, load_run, run_windows
from .trace import trace
from .trace_types import Trace


@dataclass
class Analysis:
    """Everything one analysis computed; ``report`` is report.json's content."""

    report: dict  # the report.json content
    out: Path  # output directory
    run: Path
    chars: list[str]  # vocabulary in index order
    windows: torch.Tensor  # (B, T) int64 character indices
    perturbed: torch.Tensor  # (B, T) windows with x_p replaced
    perturb_pos: int
    trace: Trace  # trained model on windows
    baseline: Trace  # step-0 model on windows
    trace_perturbed: Trace  # trained model on the perturbed windows
    decomposition: dict | None  # measured/forget_path/return_path (B, T, S) float64; None: RNN
    plots: list[Path] = field(default_factory=list)

    def _repr_html_(self) -> str:
        """Jupyter shows the same page as report.html."""
        return HtmlReport.from_analysis(self)._repr_html_()


def check_perturb_pos(position: int, length: int) -> None:
    """A perturbation position must leave at least lag 1 inside the window.

    >>> check_perturb_pos(127, 128)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --perturb-pos 127 leaves no lag in 128-character windows (0..126)
    """
    if position < 0 or position + 1 >= length:
        raise GatelensError(f"--perturb-pos {position} leaves no lag in {length}-character "
                            f"windows (0..{length - 2})")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens analyze: {msg}", file=sys.stderr)


def analyze(run: str | Path, *, checkpoint: str | int = "best", text: str | Path | None = None,
            windows: int = 32, length: int = 128, perturb_pos: int = 32,
            out: str | Path | None = None, progress: bool = True,
            timings: dict | None = None) -> Analysis:
    """Analyse a run's model and write OUT/report.json, OUT/report.md and OUT/plots/*.png.

    ``out`` defaults to RUN/analysis. ``timings``, if given, is filled with seconds per stage.
    Bad input raises GatelensError with a one-line message.
    """
    run = Path(run)
    clock = timings if timings is not None else {}
    t0 = time.perf_counter()
    loaded = load_run(run, checkpoint)
    check_perturb_pos(perturb_pos, length)
    vocab, cfg = loaded.vocab, loaded.config
    ids, source = run_windows(loaded, text, windows, length)  # (B, T)
    if text is None:
        source += f" ({windows} windows evenly spaced)"
    if vocab.size < 2:
        raise GatelensError(f"{run}: a vocabulary of {vocab.size} character cannot be perturbed")
    seed = int(cfg["train"].get("seed", 0))
    perturbed = perturb_windows(ids, perturb_pos, vocab.size, seed)  # (B, T)
    base_loaded = load_run(run, 0) if 0 in checkpoint_steps(run) else None
    clock["load"] = time.perf_counter() - t0

    _say(progress, f"tracing {windows} windows of {length} characters")
    t0 = time.perf_counter()
    model = loaded.model
    with torch.no_grad():
        x = model.encode(ids)  # (B, T, V or E)
        tr = trace(model.rnn, x)
        tr2 = trace(model.rnn, model.encode(perturbed))
        base = tr if base_loaded is None else trace(base_loaded.model.rnn,
                                                    base_loaded.model.encode(ids))
    clock["trace"] = time.perf_counter() - t0

    _say(progress, "measuring")
    t0 = time.perf_counter()
    ver = verification(model.rnn, x, tr)
    clock["verification"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    init = initial_keep_value(cfg["train"].get("forget_bias"))
    gates, units = gate_distributions(tr), unit_timescales(tr, init)
    baseline = None
    if base_loaded is not None:
        baseline = (gate_distributions(base), unit_timescales(base, init), base_loaded.step)
    dec = decompose(tr, tr2, perturb_pos)
    decay = perturbation_decay(tr, tr2, perturb_pos, decomposition=dec)
    classes = char_classes(tr, ids, vocab.chars)
    clock["analyses"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    m = cfg["model"]
    n_units = m["hidden"] * m["layers"]
    history = read_history(run)
    report = build_report(
        model={"cell": m["cell"], "hidden": m["hidden"], "layers": m["layers"],
               "step": loaded.step, "checkpoint": str(checkpoint),
               "nonlinearity": m.get("nonlinearity", "tanh") if m["cell"] == "rnn" else None,
               "vocab_size": vocab.size, "forget_bias": cfg["train"].get("forget_bias"),
               "chrono": cfg["train"].get("chrono")},
        text={"windows": windows, "length": length, "source": source},
        verification=ver, gates=gates, units=units, perturbation=decay, char_classes=classes,
        baseline=baseline, n_units=n_units, history=history)
    out = run / "analysis" if out is None else Path(out)
    best = cfg.get("best", {}).get("step")
    plots = write_plots(report, out / "plots", decay.curves, best)
    write_report_json(out / "report.json", report)
    atomic_write_text(out / "report.md",
                      render_markdown(report, [p.relative_to(out).as_posix() for p in plots]))
    result = Analysis(report=report, out=out, run=run, chars=list(vocab.chars), windows=ids,
                      perturbed=perturbed, perturb_pos=perturb_pos, trace=tr, baseline=base,
                      trace_perturbed=tr2, decomposition=dec, plots=plots)
    write_html(result)
    clock["write"] = time.perf_counter() - t0
    _say(progress, f"wrote {out / 'report.json'}, report.md, report.html and {len(plots)} plots")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gatelens analyze``."""
    parser.add_argument("run", help="run directory (from gatelens train)")
    parser.add_argument("--checkpoint", default="best",
                        help="best (default), final, or a step number")
    parser.add_argument("--text", default=None, metavar="FILE",
                        help="analyse the first WINDOWS x LENGTH characters of FILE "
                             "(default: windows evenly spaced over the validation split)")
    parser.add_argument("--windows", type=int, default=32, help="B, windows (default 32)")
    parser.add_argument("--length", type=int, default=128,
                        help="T, characters per window (default 128)")
    parser.add_argument("--perturb-pos", type=int, default=32, dest="perturb_pos",
                        help="position p of the changed character (default 32)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="output directory (default RUN/analysis)")
    parser.add_argument("--quiet", action="store_true", help="no progress messages")


def main_from_args(args: argparse.Namespace) -> int:
    """Run ``gatelens analyze``; 0 done, 1 verification failed (the report is still written)."""
    a = analyze(args.run, checkpoint=args.checkpoint, text=args.text, windows=args.windows,
                length=args.length, perturb_pos=args.perturb_pos, out=args.out,
                progress=not args.quiet)
    rep = a.report
    print(f"{a.out / 'report.json'}")
    print(f"{a.out / 'report.md'}")
    v = rep["verification"]
    if v.get("passed") is False:
        print(f"gatelens analyze: verification FAILED: max |h_hand - h_torch| = "
              f"{v['max_abs_diff_h']:.3g} > {v.get('tolerance', 1e-5):g}", file=sys.stderr)
        return 1
    return 0
