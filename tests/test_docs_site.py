"""The documentation site builds with ``mkdocs build --strict`` (issue 30, part 2).

Strict mode turns every warning into a failure: a broken link or anchor between pages, an
API page naming an object that does not exist, a docstring reference that does not
resolve. The command-line page and the families table are generated from the code by
docs/hooks/generated.py, so they are checked against the parser and the registry here. The
Tutorials pages are generated from docs/tutorials/*.py by docs/hooks/notebooks.py; this
build skips running them (tests/test_notebooks.py runs them and checks their outputs), and
a small stand-in notebook checks that a run notebook's outputs reach its page.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gatelens
from gatelens.cli import COMMANDS

pytestmark = pytest.mark.xdist_group("docs-site")  # one build for the module's tests

ROOT = Path(__file__).resolve().parents[1]


def _build(root: Path, site: Path, run_tutorials: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1",
               GATELENS_DOCS_RUN_TUTORIALS="1" if run_tutorials else "0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _text(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text("utf-8")


def test_every_nav_page_is_built(site: Path) -> None:
    for page in ("methods", "opening-models", "training", "report", "formats", "studies",
                 "cli", "api", "design", "findings", "changelog"):
        assert (site / page / "index.html").is_file(), page
    assert "Quick start" in (site / "index.html").read_text("utf-8")
    assert not (site / "hooks").exists()  # the hooks are code, not pages


TUTORIALS = {"01_your_model": "Your own model, opened",
             "02_train_and_analyse": "Train a character LSTM, then read the run",
             "03_models_from_elsewhere": "Models from elsewhere",
             "04_perturbation_split": "How long a changed character stays",
             "05_interventions": "Reaching in: patch, ablate and steer",
             "06_mamba_beside_lstm": "A Mamba beside an LSTM"}


def test_tutorials_are_pages_with_their_code(site: Path) -> None:
    nav = (site / "index.html").read_text("utf-8")
    assert "Tutorials" in nav
    for stem, title in TUTORIALS.items():
        page = _text(site, f"tutorials/{stem}")
        source = (ROOT / "docs" / "tutorials" / f"{stem}.py").read_text("utf-8")
        assert title in nav and title in page, stem
        assert page.count('<div class="highlight">') == source.count("\n# %%\n")  # code cells
        assert "import gatelens" in _plain(page) and "outputs below" not in page
        assert f'href="../{stem}.py"' in page and (site / "tutorials" / f"{stem}.py").is_file()
        assert (site / "tutorials" / f"{stem}.py").read_text("utf-8") == source
    assert "gatelens.Lens(model, vocab=chars)" in _plain(_text(site, "tutorials/01_your_model"))


def _plain(page: str) -> str:
    """A page's text without its tags (highlighted code is split into spans)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_a_run_tutorial_page_shows_its_outputs(tmp_path: Path) -> None:
    """A stand-in notebook, run by the build as the real ones are: the page shows what it
    printed, its last expression and its figure (a minimal site, so the build is quick)."""
    root = tmp_path / "mini"
    (root / "docs" / "tutorials").mkdir(parents=True)
    shutil.copytree(ROOT / "docs" / "hooks", root / "docs" / "hooks")
    (root / "docs" / "index.md").write_text("# Home\n\nSee the [tutorial](tutorials/01_tiny.md).\n")
    (root / "docs" / "tutorials" / "01_tiny.py").write_text(
        "# %% [markdown]\n# # A tiny tutorial\n#\n# Prose.\n\n# %%\n"
        "import matplotlib.pyplot as plt\nprint('printed by the cell')\nplt.plot([0, 1])\n"
        "'shown' + ' last'\n", "utf-8")
    (root / "mkdocs.yml").write_text(
        "site_name: mini\ndocs_dir: docs\nexclude_docs: |\n  hooks/\nstrict: true\n"
        "theme:\n  name: material\nhooks:\n  - docs/hooks/notebooks.py\n"
        "markdown_extensions:\n  - pymdownx.superfences\n"
        "nav:\n  - Home: index.md\n  - Tutorials:\n      - tutorials/01_tiny.md\n", "utf-8")
    done = _build(root, tmp_path / "site", run_tutorials=True)
    assert done.returncode == 0, done.stdout + done.stderr
    page = _text(tmp_path / "site", "tutorials/01_tiny")
    assert "A tiny tutorial" in page and "outputs below are from the run" in page
    assert "printed by the cell\n'shown last'" in _plain(page)
    assert page.count('src="data:image/png;base64,') == 1
    assert not (root / "docs" / "tutorials" / "01_tiny.md").exists()  # the notebook is the source


def test_cli_page_is_every_commands_help(site: Path) -> None:
    cli = _text(site, "cli")
    for name in COMMANDS:
        assert f"gatelens {name}" in cli, name
    assert "--windows" in cli and "--preset" in cli  # options, not just the command list


def test_the_cli_summary_names_every_command_and_preset() -> None:
    """docs/cli.md's hand-written summary (above the generated help) keeps up with the
    parser: every command and every study preset."""
    from gatelens.studies.spec import PRESETS

    summary = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8").split(
        "<!-- gatelens:cli -->")[0]
    missing = [n for n in COMMANDS if not re.search(rf"^ *gatelens {n}\b", summary, re.M)]
    assert not missing, missing
    assert [p for p in PRESETS if p not in summary] == []


def test_families_table_is_the_registry(site: Path) -> None:
    page = _text(site, "opening-models")
    for name in gatelens.families():
        assert f"<code>{name}</code>" in page, name


def test_api_and_changelog_pages(site: Path) -> None:
    api = _text(site, "api")
    for name in ("gatelens.lens.lens.Lens", "gatelens.readout.trace.trace",
                 "gatelens.readout.verify.verify", "gatelens.lens.analyze.analyze",
                 "gatelens.readout.verify.VerifyResult", "gatelens.lens.lens.LensResult"):
        assert name in api, name
    assert "&gt;&gt;&gt; " in api and "<blockquote>" not in api  # doctests are code blocks
    assert "0.2.0" in _text(site, "changelog")


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    root = tmp_path / "copy"
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copy(ROOT / "CHANGELOG.md", root / "CHANGELOG.md")
    shutil.copytree(ROOT / "docs", root / "docs")
    (root / "docs" / "findings.md").write_text("# Findings\n\nSee [gone](no-such-page.md).\n")
    done = _build(root, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def test_every_python_block_of_the_docs_is_run_by_a_test() -> None:
    """Each ```python block of docs/*.md runs in a test: tests/test_readme.py reads every
    docs/*.md page beside the README and fails on a block no test of its runs.

    The Tutorials pages are not docs/*.md: they are generated from docs/tutorials/*.py,
    whose code tests/test_notebooks.py runs, so the rule does not reach them."""
    spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "tests/test_readme.py")
    examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(examples)
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert set(pages) <= set(examples.sources())
    run = set(examples.blocks())
    found = 0
    for page in pages:
        for block in _python_blocks(page.read_text("utf-8")):
            assert block.rstrip("\n") in run, f"{page.name}: a Python block no test runs:\n{block}"
            assert sum(word in block for word in examples.COVERED) == 1, page.name
            found += 1
    assert found >= 5  # the quick start, the trace, the checkpoint, ONNX/Keras, interventions


def _python_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_fence_doctests() -> None:
    spec = importlib.util.spec_from_file_location("doctest_fences",
                                                  ROOT / "docs/hooks/doctest_fences.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = "Adds.\n\n>>> f(1,\n...   2)\n[3][0]\n\nDone.\n    >>> g()"
    assert mod.fence_doctests(text) == (
        "Adds.\n\n```pycon\n>>> f(1,\n...   2)\n[3][0]\n```\n\nDone.\n    ```pycon\n"
        "    >>> g()\n```")
