"""report.html in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

Nothing here is skipped: without /usr/bin/chromium or the ``playwright`` package the
tests fail and say what to install (.ci/run installs both).
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import numpy as np
import pytest

from gatelens.report.html import write_html
from gatelens.report.write import write_analysis

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
T, P = 48, 10  # characters per window, perturbation position


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = shutil.which("chromium") or (str(CHROMIUM) if CHROMIUM.exists() else None)
    if chromium is None:
        pytest.fail("Chromium not found: `apt-get install -y chromium` (Debian package)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright for Python is missing: `.venv/bin/pip install playwright` "
                    "(never `playwright install`; the system Chromium is used)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=ARGS)
        yield b
        b.close()


class Page:
    """One page opened from file://, with every request and console message recorded."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: m.type in ("error", "warning")
                     and self.errors.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector("body[data-ready='1']", timeout=10_000)

    def _route(self, route: Any) -> None:
        url = route.request.url
        self.requests.append(url)
        if url.startswith(("file:", "data:")):
            route.continue_()
        else:
            route.abort()

    def colours(self, selector: str = "#windows .ch") -> list[str]:
        return self.page.eval_on_selector_all(selector,
                                              "es => es.map(e => e.style.backgroundColor)")

    def unit(self) -> int:
        return int(self.page.get_attribute("#units tbody tr.sel", "data-unit"))


@pytest.fixture(scope="module", params=["lstm", "gru", "rnn_tanh"])
def page(browser: Any, tmp_path_factory: pytest.TempPathFactory,
         request: pytest.FixtureRequest, analysis_of) -> Iterator[Page]:
    a = analysis_of(request.param, windows=6, length=T, hidden=24, perturb_pos=P)
    write_analysis(a, tmp_path_factory.mktemp(request.param))  # a real analysis, every file
    p = Page(browser, write_html(a, max_windows=3))
    p.analysis = a
    yield p
    p.context.close()


def test_loads_offline_without_errors(page: Page) -> None:
    assert page.errors == []
    assert all(u.startswith(("file:", "data:")) for u in page.requests), page.requests
    assert page.requests[0].startswith("file:")


def test_one_element_per_character(page: Page) -> None:
    texts = page.page.eval_on_selector_all(
        "#windows .chars", "ws => ws.map(w => w.querySelectorAll('.ch').length)")
    assert texts == [T, T, T]
    assert page.page.locator("#windows .chars > :not(.ch)").count() == 0
    first = page.page.eval_on_selector_all("#windows .win:first-child .ch",
                                           "es => es.map(e => e.textContent)")
    expected = "".join(page.analysis.chars[c] for c in page.analysis.windows[0].tolist())
    assert "".join(first).replace("↵", "") == expected
    assert page.page.text_content("#wincount").startswith("Showing 3 of 6")


def test_picking_a_unit_recolours_the_text(page: Page) -> None:
    before, unit = page.colours(), page.unit()
    assert len(set(before)) > 1 and all(before)
    other = page.page.locator(f"#units tbody tr:not([data-unit='{unit}'])").nth(5)
    other.click()
    assert page.unit() != unit
    assert page.colours() != before
    title = page.page.get_attribute("#windows .ch >> nth=3", "title")
    assert "=" in title and "position 3" in title


def test_arrow_keys_step_through_units(page: Page) -> None:
    page.page.locator("#units thead th[data-key='unit']").click()  # ascending by index
    page.page.locator("#units tbody tr[data-unit='4']").click()
    before = page.colours()
    page.page.keyboard.press("ArrowDown")
    assert page.unit() == 5
    assert page.colours() != before
    page.page.keyboard.press("ArrowUp")
    page.page.keyboard.press("ArrowUp")
    assert page.unit() == 3


def test_sorting_and_model_toggle(page: Page) -> None:
    # from a known order (the page is shared by this module's tests, in any order under
    # xdist): by unit, then by mean, which sorts descending on its first click
    page.page.locator("#units thead th[data-key='unit']").click()
    page.page.locator("#units thead th[data-key='mean']").click()
    order = page.page.eval_on_selector_all("#units tbody tr", "rs => rs.map(r => +r.dataset.unit)")
    means = page.page.evaluate("JSON.parse(document.getElementById('gl-data').textContent)"
                               ".units.layer0.mean")
    assert [means[u] for u in order] == sorted(means, reverse=True)
    before = page.colours()
    page.page.locator("#models button[data-value='untrained']").click()
    assert page.colours() != before
    page.page.locator("#models button[data-value='trained']").click()
    assert page.colours() == before
    page.page.locator("#ranges button[data-value='unit']").click()
    assert page.colours() != before
    page.page.locator("#ranges button[data-value='fixed']").click()
    assert page.colours() == before


def test_perturbation_view(page: Page) -> None:
    marked = page.page.eval_on_selector_all("#ptext .ch", "es => es.map(e => e.className)")
    assert len(marked) == T and marked.index("ch pert") == P and marked.count("ch pert") == 1
    lines = page.page.locator("#pchart polyline").count()
    assert lines == (1 if page.analysis.decomposition is None else 3)
    before = page.colours("#ptext .ch")
    page.page.locator("#pmodes button[data-value='norm']").click()
    assert page.colours("#ptext .ch") != before
    page.page.locator("#pmodes button[data-value='unit']").click()


def test_screenshot_is_not_blank(page: Page) -> None:
    png = page.page.screenshot(full_page=False)
    img = mpimg.imread(io.BytesIO(png), format="png")  # (H, W, 3|4) floats
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 100
    assert page.errors == []
