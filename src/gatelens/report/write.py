"""Writing an analysis: report.json, report.md, the plots and report.html, all read from
the ``Analysis`` result objects.

    OUT/report.json   OUT/report.md   OUT/plots/*.png   OUT/report.html   OUT/page_data.json
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gatelens.io import atomic_write_text
from gatelens.report.html import write_html
from gatelens.report.json_report import write_report_json
from gatelens.report.markdown import render_markdown
from gatelens.report.plots import write_plots

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis


def write_analysis(analysis: Analysis, out: str | Path, plots: bool = True) -> Analysis:
    """Write every file of ``analysis`` under ``out`` (created); sets ``analysis.out`` and
    ``analysis.plots``. Each file is written atomically. ``plots=False`` leaves out the PNGs
    (the slow part; a study plots only each trial's final checkpoint)."""
    out = Path(out)
    analysis.out = out
    report = analysis.report
    analysis.plots = write_plots(report, out / "plots", analysis.perturbation.curves,
                                 analysis.best_step) if plots else []
    write_report_json(out / "report.json", report)
    atomic_write_text(out / "report.md", render_markdown(
        report, [p.relative_to(out).as_posix() for p in analysis.plots]))
    write_html(analysis)
    return analysis
