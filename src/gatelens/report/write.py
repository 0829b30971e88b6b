"""Writing an analysis: report.json, report.md, the plots and report.html, all read from
the ``Analysis`` result objects.

    OUT/report.json   OUT/report.md   OUT/plots/*.png   OUT/report.html   OUT/page_data.json

The files appear together or not at all: they are written into a temporary directory
beside OUT, which then takes OUT's place (``gatelens.io.replace_dir``). A failure or
Ctrl-C at any point leaves the previous analysis in OUT as it was. Because OUT is replaced
whole, it must hold nothing but an analysis.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gatelens.errors import GatelensError, wrapped_os_error, write_error
from gatelens.io import atomic_write, atomic_write_text, replace_dir, temp_dir_beside
from gatelens.lock import is_lock_or_leftover
from gatelens.report.html import write_html
from gatelens.report.json_report import ARRAYS, report_arrays, write_report_json
from gatelens.report.markdown import render_markdown
from gatelens.report.plots import write_plots
from gatelens.report.plots_memory import write_memory_plots

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis

#: What an analysis directory holds; ``write_analysis`` replaces a directory only if it
#: holds nothing else.
ANALYSIS_FILES = ("report.json", "report.md", "report.html", "page_data.json", "plots",
                  ARRAYS)


def check_analysis_out(out: str | Path) -> None:
    """GatelensError if ``out`` exists and holds anything but an analysis (it is replaced
    whole, so e.g. ``--out .`` or ``--out RUN`` must not be).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text("{}")
    >>> check_analysis_out(d)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --out ...: holds config.json, which is not part of ...
    """
    out = Path(out)
    if not out.is_dir():
        return
    other = sorted(p.name for p in out.iterdir()
                   if p.name not in ANALYSIS_FILES and not is_lock_or_leftover(p.name))
    if other:
        shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
        raise GatelensError(f"--out {out}: holds {shown}, which is not part of an analysis; an "
                            "analysis replaces its directory whole, so give it a directory of "
                            "its own")


def write_analysis(analysis: Analysis, out: str | Path, plots: bool = True) -> Analysis:
    """Write every file of ``analysis`` under ``out`` at once (module docstring); sets
    ``analysis.out`` and ``analysis.plots``. ``plots=False`` leaves out the PNGs (the slow
    part; a study plots only each trial's final checkpoint)."""
    out = Path(out)
    check_analysis_out(out)
    tmp = temp_dir_beside(out)
    try:
        analysis.out = tmp
        report = analysis.report
        arrays = report_arrays(analysis)  # what report.json summarises, whole
        if arrays:
            from safetensors.numpy import save_file

            atomic_write(tmp / ARRAYS, lambda t: save_file(  # a full disk: one line
                {k: v.astype(np.float32) for k, v in arrays.items()}, str(t)))
        analysis.plots = write_plots(report, tmp / "plots", analysis.perturbation.curves,
                                     analysis.best_step, arrays) if plots else []
        if plots:
            analysis.plots += write_memory_plots(report, tmp / "plots", analysis.lyapunov,
                                                 arrays)
        write_report_json(tmp / "report.json", report)
        atomic_write_text(tmp / "report.md", render_markdown(
            report, [p.relative_to(tmp).as_posix() for p in analysis.plots]))
        write_html(analysis)
        replace_dir(tmp, out)
    except BaseException as e:
        analysis.out = out
        shutil.rmtree(tmp, ignore_errors=True)
        failed = wrapped_os_error(e)  # safetensors' "(os error 28)" is an OSError too
        if failed is not None:  # named where it would have been, not in the gone tmp
            where = _final(getattr(failed, "path", None) or failed.filename, tmp, out)
            raise write_error(where, OSError(failed.errno, getattr(
                failed, "reason", None) or failed.strerror)) from None
        raise
    analysis.out = out
    analysis.plots = [out / p.relative_to(tmp) for p in analysis.plots]
    return analysis


def _final(path: object, tmp: Path, out: Path) -> Path:
    """Where ``path`` (a file the write failed on, often inside the temporary directory
    that is gone by now) would have been: under ``out``; ``out`` itself if unknown.

    >>> str(_final("/a/.out.x1.tmp/plots/p.png", Path("/a/.out.x1.tmp"), Path("/a/out")))
    '/a/out/plots/p.png'
    """
    if path is None:
        return out
    try:
        return out / Path(path).relative_to(tmp)
    except ValueError:
        return Path(path)
