"""``gatelens analyze``: a run directory, or a weights file, measured through ``Lens`` and
written (``gatelens.report.write``). A run is a model plus its step-0 baseline and its keep
gate's starting value (``gatelens.load_run``: a ``Run`` context), so ``analyze RUN`` and
``Lens(gatelens.load_run(RUN)).analyze(...)`` are one computation.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gatelens.analysis.measure import Analysis
from gatelens.analysis.settings import AnalysisSettings, check_perturb_pos
from gatelens.lens.lens import Lens
from gatelens.lens.run import load_run

if TYPE_CHECKING:
    from gatelens.lens.foreign import ForeignModel

#: where a gatelens run's recurrent module sits in its CharLM
RUN_MODULE = "rnn"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gatelens analyze: {msg}", file=sys.stderr)


def analyze(run: str | Path, settings: AnalysisSettings | None = None, *,
            checkpoint: str | int = "best", text: str | Path | None = None,
            out: str | Path | None = None, progress: bool = True,
            timings: dict | None = None, plots: bool = True, chunk: int | None = None,
            device: str | None = None, **options: Any) -> Analysis:
    """Analyse a run's model; write OUT/report.json, report.md, plots/*.png and report.html.

    ``settings`` (an ``AnalysisSettings``, or its fields as keyword arguments) says what is
    measured. ``out`` defaults to RUN/analysis. ``windows="all"``: every whole window of
    the validation split (or of ``text``). ``timings``, if given, is filled with seconds
    per stage. ``plots=False`` writes no PNGs (report.json, report.md and report.html
    still). Bad input raises GatelensError with a one-line message.
    """
    from gatelens.io import check_out_dir
    from gatelens.report.write import write_analysis

    s = AnalysisSettings.build(settings, **options)
    run = Path(run)
    dest = run / "analysis" if out is None else Path(out)
    check_out_dir(dest, flag="--out")
    clock = timings if timings is not None else {}
    t0 = time.perf_counter()
    check_perturb_pos(s.perturb_pos, s.length)
    ctx = load_run(run, checkpoint)
    ids, source = ctx.windows(s.windows, s.length, text)  # (B, T)
    lens = Lens(ctx, device=device)  # device None: the CPU the run loads on
    clock["load"] = time.perf_counter() - t0
    _say(progress, f"tracing {ids.shape[0]} windows of {s.length} characters")
    # a gatelens run: the module is the run's own, so its path is "" (design.md)
    a = lens.measure(RUN_MODULE, ids, list(ctx.vocab), s,
                     text={"windows": int(ids.shape[0]), "length": s.length, "source": source},
                     model={**lens.describe(RUN_MODULE), "path": ""},
                     chunk=chunk, progress=progress, timings=clock)
    t0 = time.perf_counter()
    write_analysis(a, dest, plots=plots)
    clock["write"] = time.perf_counter() - t0
    _say(progress, f"wrote {a.out / 'report.json'}, report.md, report.html and "
                   f"{len(a.plots)} plots")
    return a


def analyze_foreign(model: ForeignModel, settings: AnalysisSettings | None = None, *,
                    text: str | Path, out: str | Path, chunk: int | None = None,
                    progress: bool = False, device: str | None = None,
                    **options: Any) -> Analysis:
    """Analyse weights gatelens did not train (``gatelens.lens.foreign``) on the first windows
    of a text file, through ``Lens``; writes the same files as ``analyze``. ``settings`` as
    ``analyze`` takes them (the seed defaults to 0)."""
    from gatelens.report.write import write_analysis

    s = AnalysisSettings.build(settings, **options)
    lens = Lens(model, vocab=list(model.vocab), device=device)
    ids, chars, source = lens.windows(Path(text), s.windows, s.length)  # (B, T)
    info = {k: v for k, v in lens.describe(RUN_MODULE).items() if k != "class"}
    info.update(path=model.prefix.rstrip("."), weights=str(model.source),
                notes=list(getattr(model, "notes", [])))  # report.md shows the notes
    a = lens.measure(RUN_MODULE, ids, chars, s, model=info,
                     text={"windows": int(ids.shape[0]), "length": s.length,
                           "source": str(text)}, chunk=chunk, progress=progress)
    return write_analysis(a, out)
