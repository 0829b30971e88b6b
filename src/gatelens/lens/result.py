"""What ``Lens.analyze`` gives: one ``Analysis`` per recurrent module path, and the index
page that links them (written, with each analysis, where an output directory is given).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gatelens.report.index import dirname, index_page

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis

__all__ = ["LensResult"]


@dataclass
class LensResult:
    """What ``Lens.analyze`` measured: one ``Analysis`` per recurrent module path."""

    analyses: dict[str, Analysis]
    out: Path | None = None
    index_html: str = ""
    #: path -> a note on the output-level reach: why there is none, or how it was read
    notes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def written(cls, analyses: dict[str, Analysis], out: str | os.PathLike | None) -> LensResult:
        """``analyses`` with their index page; with ``out``, written as ``analyze`` writes."""
        from gatelens.io import atomic_write_text
        from gatelens.report.write import write_analysis

        notes = {p: a.reach_note for p, a in analyses.items() if a.reach_note}
        result = cls(analyses, None if out is None else Path(out), notes=notes)
        for path, a in analyses.items() if result.out is not None else ():
            write_analysis(a, result.out / dirname(path))
        result.index_html = index_page(result)
        if result.out is not None:
            atomic_write_text(result.out / "index.html", result.index_html)
        return result

    @property
    def reports(self) -> dict[str, dict]:
        """{module path: report.json dict}."""
        return {path: a.report for path, a in self.analyses.items()}

    def _repr_html_(self) -> str:
        """Jupyter shows the index page (isolated in an iframe, as report.html is)."""
        from gatelens.report.html import HtmlReport

        return HtmlReport(self.index_html, height=320)._repr_html_()
