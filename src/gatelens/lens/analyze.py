"""``gatelens analyze``: a run directory, or a weights file, measured and written.

Both end in ``gatelens.analysis.measure.measure``; the files are written by
``gatelens.report.write``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gatelens.analysis.measure import Analysis, check_perturb_pos, encoder_runner, measure
from gatelens.training.model import initial_keep_value
from gatelens.training.runs import checkpoint_steps, load_run, run_windows

if TYPE_CHECKING:
    from gatelens.lens.foreign import ForeignModel


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens analyze: {msg}", file=sys.stderr)


def analyze(run: str | Path, *, checkpoint: str | int = "best", text: str | Path | None = None,
            windows: int = 32, length: int = 128, perturb_pos: int = 32,
            out: str | Path | None = None, progress: bool = True,
            timings: dict | None = None, plots: bool = True) -> Analysis:
    """Analyse a run's model; write OUT/report.json, report.md, plots/*.png and report.html.

    ``out`` defaults to RUN/analysis. ``timings``, if given, is filled with seconds per stage.
    ``plots=False`` writes no PNGs (report.json, report.md and report.html still).
    Bad input raises GatelensError with a one-line message.
    """
    from gatelens.report.json_report import read_history
    from gatelens.report.write import write_analysis

    run = Path(run)
    clock = timings if timings is not None else {}
    t0 = time.perf_counter()
    loaded = load_run(run, checkpoint)
    check_perturb_pos(perturb_pos, length)
    cfg, m = loaded.config, loaded.config["model"]
    ids, source = run_windows(loaded, text, windows, length)  # (B, T)
    if text is None:
        source += f" ({windows} windows evenly spaced)"
    base = load_run(run, 0) if 0 in checkpoint_steps(run) else None
    clock["load"] = time.perf_counter() - t0
    _say(progress, f"tracing {windows} windows of {length} characters")
    model = loaded.model
    a = measure(
        model.rnn, encoder_runner(model.encode, lambda i: model(i)[0]), ids,
        list(loaded.vocab.chars),
        perturb_pos=perturb_pos, seed=int(cfg["train"].get("seed", 0)),
        init_value=initial_keep_value(cfg["train"].get("forget_bias")),
        baseline=None if base is None else (base.step, base.model.rnn,
                                            encoder_runner(base.model.encode)),
        model={"cell": m["cell"], "hidden": m["hidden"], "layers": m["layers"],
               "step": loaded.step, "checkpoint": str(checkpoint),
               "nonlinearity": m.get("nonlinearity", "tanh") if m["cell"] == "rnn" else None,
               "vocab_size": loaded.vocab.size, "forget_bias": cfg["train"].get("forget_bias"),
               "chrono": cfg["train"].get("chrono")},
        text={"windows": windows, "length": length, "source": source}, timings=clock)
    a.history, a.best_step = read_history(run), cfg.get("best", {}).get("step")
    synthetic = cfg.get("corpus", {}).get("synthetic")
    if synthetic:  # read the model's loss against what memory could and could not buy
        a.control = {"corpus": synthetic["name"], "memoryless_loss": synthetic["memoryless_loss"],
                     "best_loss": synthetic["best_loss"],
                     "best_val_loss": cfg.get("best", {}).get("val_loss")}
    t0 = time.perf_counter()
    write_analysis(a, run / "analysis" if out is None else Path(out), plots=plots)
    clock["write"] = time.perf_counter() - t0
    _say(progress, f"wrote {a.out / 'report.json'}, report.md, report.html and "
                   f"{len(a.plots)} plots")
    return a


def analyze_foreign(model: ForeignModel, *, text: str | Path, windows: int = 32,
                    length: int = 128, perturb_pos: int = 32, out: str | Path,
                    seed: int = 0) -> Analysis:
    """Analyse weights gatelens did not train (``gatelens.lens.foreign``) on the first windows of
    a text file; writes the same files as ``analyze``."""
    from gatelens.report.write import write_analysis
    from gatelens.training.corpus import Vocab, analysis_windows, read_text_file

    ids = analysis_windows(Vocab(list(model.vocab)), windows, length,
                           text=read_text_file(text), where=str(text))  # (B, T)
    a = measure(model.rnn, encoder_runner(model.encode, model if model.head is not None
                                          else None), ids, list(model.vocab),
                perturb_pos=perturb_pos, seed=seed,
                model={"cell": model.cell, "hidden": model.hidden, "layers": model.layers,
                       "step": None, "path": model.prefix.rstrip("."),
                       "weights": str(model.source),
                       "notes": list(getattr(model, "notes", []))},  # report.md shows them
                text={"windows": windows, "length": length, "source": str(text)})
    return write_analysis(a, out)
