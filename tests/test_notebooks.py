"""The tutorials under notebooks/ run, cell by cell, as a reader would run them (issue 30,
part 3).

The notebooks are jupytext percent files; no Jupyter kernel is needed to run them:
``run_cells`` executes their code cells in order in one namespace (as one kernel would),
in a fresh directory, with matplotlib's Agg backend, and shows each cell's last expression
the way Jupyter would (its ``_repr_html_`` is called, so a result that no longer renders
fails here). Every notebook must finish within a minute (each takes seconds here). The
cells are split by docs/hooks/notebooks.py, the code that renders them into the site, so
what the site shows is what ran.
"""

from __future__ import annotations

import ast
import importlib.util
import time
from pathlib import Path
from typing import Any

import matplotlib
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebooks_hook", ROOT / "docs/hooks/notebooks.py")
hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook)

NOTEBOOKS = hook.notebooks(ROOT)
#: the issue's "each under a minute on the CPU", on the 2-core machine: CPU seconds of this
#: process (both cores), so other jobs sharing the cores do not count (each takes 10-30 s)
BUDGET_CPU_S = 120.0


def run_cells(path: Path) -> dict[str, Any]:
    """Execute a notebook's code cells in order in one namespace; returns the namespace.

    A cell's last expression statement is evaluated and, as Jupyter would, rendered: an
    object with ``_repr_html_`` is asked for its HTML. A failing cell raises with the
    notebook and cell number in its traceback's file name.
    """
    ns: dict[str, Any] = {"__name__": "__main__"}
    for i, cell in enumerate(c for c in hook.cells(path.read_text("utf-8")) if c.kind == "code"):
        tree = ast.parse(cell.source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        where = f"{path.name}:cell{i}"
        exec(compile(tree, where, "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), where, "eval"), ns)
            if hasattr(value, "_repr_html_"):
                html = value._repr_html_()
                assert isinstance(html, str) and html, f"{where}: an empty _repr_html_"
            ns["_"] = value
    return ns


@pytest.fixture
def agg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A fresh working directory and the non-interactive backend; figures closed after."""
    import matplotlib.pyplot as plt

    monkeypatch.chdir(tmp_path)
    backend = matplotlib.get_backend()
    plt.switch_backend("Agg")
    yield tmp_path
    plt.close("all")
    plt.switch_backend(backend)


def test_there_are_four_tutorials() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_your_model.py", "02_train_and_analyse.py",
                                           "03_models_from_elsewhere.py",
                                           "04_perturbation_split.py"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, agg: Path) -> None:
    start = time.process_time()
    ns = run_cells(path)
    took = time.process_time() - start
    assert took < BUDGET_CPU_S, f"{path.name} took {took:.0f} CPU seconds"
    CHECKS[path.stem](ns, agg)


def _check_your_model(ns: dict, out: Path) -> None:
    a = ns["a"]
    assert type(a).__name__ == "Analysis" and a.verification.passed
    assert 0 < a.perturbation.half_life_forget_only < a.perturbation.half_life_measured
    assert a.units.n_units == 2 * 32 and len(a.units.half_lives) == 64
    assert (out / "lens_out/lstm/report.html").is_file() and (out / "lens_out/index.html").is_file()
    assert ns["check"].passed and tuple(ns["tr"]["layer1.f"].shape) == (4, 64, 32)


def _check_train(ns: dict, out: Path) -> None:
    assert ns["code"] == 0 and ns["config"]["best"]["step"] == 150
    assert ns["steps"] == [0, 75, 150] and ns["mean_f"][0] == pytest.approx(0.5, abs=0.02)
    a = ns["a"]
    assert a.baseline.step == 0 and a.control["memoryless_loss"] > a.control["best_loss"]
    assert ns["report"]["perturbation"]["half_life_measured"] == pytest.approx(
        a.perturbation.half_life_measured, rel=1e-6)  # the CLI and Lens: the same figures


def _check_elsewhere(ns: dict, out: Path) -> None:
    assert ns["tr"].meta["onnx_max_abs_diff_h"] < 1e-5
    assert (out / "my-mamba/config.json").is_file()
    analyses = ns["result"].analyses
    assert analyses and all(a.verification.passed for a in analyses.values())
    assert {a.model["family"] for a in analyses.values()} == {"hf-mamba"}
    assert "hf-mamba" in ns["_"]


def _check_split(ns: dict, out: Path) -> None:
    gap, mingru_return = ns["_"]
    assert gap < 1e-5 and mingru_return == 0.0
    lstm = ns["analyses"]["lstm"].perturbation
    assert lstm.half_life_measured > lstm.half_life_forget_only  # the LSTM's return path


CHECKS = {"01_your_model": _check_your_model, "02_train_and_analyse": _check_train,
          "03_models_from_elsewhere": _check_elsewhere, "04_perturbation_split": _check_split}


def test_cells_and_page() -> None:
    text = ("# ---\n# jupyter: {}\n# ---\n\n# %% [markdown]\n# # A title\n#\n# Some *prose*.\n"
            "\n# %%\nx = 1\n\n\n# %% tags=['x']\ny = x + 1\ny\n\n# %%\n\n")
    assert [(c.kind, c.source) for c in hook.cells(text)] == [
        ("markdown", "# A title\n\nSome *prose*."), ("code", "x = 1"), ("code", "y = x + 1\ny")]
    assert hook.title(text) == "A title"
    page = hook.to_markdown(text, "notebooks/01_x.py")
    assert page.startswith("# A title\n\nSome *prose*.\n\n*A notebook")
    assert "`notebooks/01_x.py`" in page and page.count("```python\n") == 2
    with pytest.raises(ValueError, match="Title"):
        hook.title("# %%\nx = 1\n")


def test_a_failing_cell_names_its_notebook_and_cell(tmp_path: Path) -> None:
    nb = tmp_path / "09_bad.py"
    nb.write_text("# %% [markdown]\n# # Bad\n\n# %%\nx = 1\n\n# %%\n1 / (x - 1)\n", "utf-8")
    with pytest.raises(ZeroDivisionError) as err:
        run_cells(nb)
    assert err.traceback[-1].path == Path("09_bad.py:cell1") or \
        "09_bad.py:cell1" in str(err.traceback[-1].path)


def test_every_notebook_has_a_title_and_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text("utf-8")
    for nb in NOTEBOOKS:
        hook.title(nb.read_text("utf-8"))
        assert f"{hook.PAGES}/{nb.stem}.md" in nav, nb.name
