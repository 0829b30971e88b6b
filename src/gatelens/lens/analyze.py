"""``gatelens analyze``: a run directory, or a weights file, measured through ``Lens`` and
written (``gatelens.report.write``). A run is a model plus its step-0 baseline and its keep
gate's starting value (``gatelens.load_run``), so ``analyze RUN`` and
``Lens(gatelens.load_run(RUN)).analyze(...)`` are one computation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gatelens.analysis.measure import Analysis, check_perturb_pos
from gatelens.analysis.settings import DEFAULTS
from gatelens.lens.lens import Lens
from gatelens.lens.run import load_run

if TYPE_CHECKING:
    from gatelens.lens.foreign import ForeignModel

#: where a gatelens run's recurrent module sits in its CharLM
RUN_MODULE = "rnn"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens analyze: {msg}", file=sys.stderr)


def analyze(run: str | Path, *, checkpoint: str | int = "best", text: str | Path | None = None,
            windows: int | str = DEFAULTS.windows, length: int = DEFAULTS.length,
            perturb_pos: int = DEFAULTS.perturb_pos,
            out: str | Path | None = None, progress: bool = True,
            timings: dict | None = None, plots: bool = True, chunk: int | None = None,
            exponents: int | str = DEFAULTS.exponents,
            fixed_points: bool = DEFAULTS.fixed_points,
            memory_windows: int = DEFAULTS.memory_windows) -> Analysis:
    """Analyse a run's model; write OUT/report.json, report.md, plots/*.png and report.html.

    ``out`` defaults to RUN/analysis. ``windows="all"``: every whole window of the
    validation split (or of ``text``). ``timings``, if given, is filled with seconds per
    stage. ``plots=False`` writes no PNGs (report.json, report.md and report.html still).
    Bad input raises GatelensError with a one-line message.
    """
    from gatelens.io import check_out_dir
    from gatelens.report.write import write_analysis

    run = Path(run)
    dest = run / "analysis" if out is None else Path(out)
    check_out_dir(dest, flag="--out")
    clock = timings if timings is not None else {}
    t0 = time.perf_counter()
    check_perturb_pos(perturb_pos, length)
    model = load_run(run, checkpoint)
    info = model.gatelens_run
    ids, source = info.windows(windows, length, text)  # (B, T)
    lens = Lens(model)
    clock["load"] = time.perf_counter() - t0
    _say(progress, f"tracing {ids.shape[0]} windows of {length} characters")
    a = lens.measure(RUN_MODULE, ids, list(info.vocab), perturb_pos=perturb_pos,
                     text={"windows": int(ids.shape[0]), "length": length, "source": source},
                     chunk=chunk, progress=progress, timings=clock, exponents=exponents,
                     fixed_points=fixed_points, memory_windows=memory_windows)
    a.model["path"] = ""  # a gatelens run: the module is the run's own (design.md)
    t0 = time.perf_counter()
    write_analysis(a, dest, plots=plots)
    clock["write"] = time.perf_counter() - t0
    _say(progress, f"wrote {a.out / 'report.json'}, report.md, report.html and "
                   f"{len(a.plots)} plots")
    return a


def analyze_foreign(model: ForeignModel, *, text: str | Path,
                    windows: int | str = DEFAULTS.windows, length: int = DEFAULTS.length,
                    perturb_pos: int = DEFAULTS.perturb_pos, out: str | Path,
                    seed: int = 0, chunk: int | None = None, progress: bool = False,
                    exponents: int | str = DEFAULTS.exponents,
                    fixed_points: bool = DEFAULTS.fixed_points) -> Analysis:
    """Analyse weights gatelens did not train (``gatelens.lens.foreign``) on the first windows
    of a text file, through ``Lens``; writes the same files as ``analyze``."""
    from gatelens.report.write import write_analysis

    lens = Lens(model, vocab=list(model.vocab))
    ids, chars, source = lens.windows(Path(text), windows, length)  # (B, T)
    a = lens.measure(RUN_MODULE, ids, chars, perturb_pos=perturb_pos, seed=seed,
                     text={"windows": int(ids.shape[0]), "length": length,
                           "source": str(text)}, chunk=chunk, progress=progress,
                     exponents=exponents, fixed_points=fixed_points)
    a.model.update(path=model.prefix.rstrip("."), weights=str(model.source),
                   notes=list(getattr(model, "notes", [])))  # report.md shows the notes
    a.model.pop("class", None)
    return write_analysis(a, out)
