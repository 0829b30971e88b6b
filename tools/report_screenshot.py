"""Make docs/img/report.png: a screenshot of report.html from a real analysis.

Trains a small character LSTM on the default corpus (128 units, 400 steps: about a minute
of CPU), analyses it with ``gatelens analyze`` and photographs the page's top in headless
Chromium (Debian's ``chromium``, driven by Playwright, as tests/test_html_browser.py does)::

    python tools/report_screenshot.py [WORKDIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from gatelens.cli import main

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def shoot(html: Path, png: Path, width: int = 1280, height: int = 900) -> None:
    """Open ``html`` from disk and save the first ``height`` pixels of it as ``png``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(html.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        page.screenshot(path=str(png))
        browser.close()


def run(work: Path) -> Path:
    """Train, analyse and photograph under ``work``; returns the PNG's path."""
    run_dir = work / "run"
    if not (run_dir / "model.safetensors").exists():
        assert main(["train", "--hidden", "128", "--steps", "400", "--eval-every", "100",
                     "--out", str(run_dir)]) == 0
    assert main(["analyze", str(run_dir), "--windows", "32", "--out",
                 str(work / "analysis")]) == 0
    png = ROOT / "docs" / "img" / "report.png"
    shoot(work / "analysis" / "report.html", png)
    return png


if __name__ == "__main__":
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    print(run(work))
