"""The tutorials under docs/tutorials/ run, cell by cell, as a reader would run them (issue
30, part 3).

The notebooks are jupytext percent files; no Jupyter kernel is needed to run them:
``run_cells`` (docs/hooks/notebooks.py, the code the site build runs them with) executes
their code cells in order in one namespace (as one kernel would), in a fresh directory,
with matplotlib's Agg backend, and shows each cell's last expression the way Jupyter would
(its ``_repr_html_`` is called, so a result that no longer renders fails here). Every
notebook must finish within a minute of CPU; its cells assert what they show, the checks
below read the names they leave, and the page rendered from the run must show what the
reader is told to look at.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebooks_hook", ROOT / "docs/hooks/notebooks.py")
hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook)

NOTEBOOKS = hook.notebooks(ROOT)
#: the issue's "each under a minute on the CPU", on the 2-core machine: CPU seconds of this
#: process (both cores), so other jobs sharing the cores do not count (each takes 3-10 s)
BUDGET_CPU_S = 60.0
run_cells = hook.run_cells


@pytest.fixture
def agg() -> Path:
    """A fresh working directory, the non-interactive backend and one torch thread: the
    site build's own ``sandbox``."""
    with hook.sandbox() as tmp:
        yield tmp


def test_there_are_six_tutorials() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_your_model.py", "02_train_and_analyse.py",
                                           "03_models_from_elsewhere.py",
                                           "04_perturbation_split.py", "05_interventions.py",
                                           "06_mamba_beside_lstm.py"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, agg: Path) -> None:
    start = time.process_time()
    ns, outputs = run_cells(path)
    took = time.process_time() - start
    assert took < BUDGET_CPU_S, f"{path.name} took {took:.0f} CPU seconds"
    CHECKS[path.stem](ns, agg)
    page = hook.to_markdown(path.read_text("utf-8"), path.name, outputs)
    shown, figures = SHOWN[path.stem]  # what the page shows a reader: outputs and figures
    for line in shown:
        assert line in page, f"{path.name}: the page does not show {line!r}"
    assert page.count('src="data:image/png;base64,') == figures


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


def _check_interventions(ns: dict, out: Path) -> None:
    res, cut, st = ns["res"], ns["cut"], ns["st"]
    assert res.effect.shape == (2, 13) and abs(res.effect[:, :4]).max() < 1e-5
    assert res.m_clean > res.m_corrupt  # the trained model prefers "l" after "dog"
    assert cut.max_abs_diff < 1e-5 and cut.pooled.uncut[0] >= cut.pooled.measured[0] * 0.5
    assert ns["ab"].kl_at_p > 0 and st.kl[0] > 0 and len(st.rise) == 5


def _check_mamba(ns: dict, out: Path) -> None:
    a = ns["analyses"]
    assert {n: (x.model["family"], x.units.gate) for n, x in a.items()} == {
        "lstm": ("lstm", "f"), "hf-mamba": ("hf-mamba", "a")}
    assert all(x.verification.passed and x.perturbation.half_life_measured > 0
               for x in a.values())


#: lines each page must show from the run, and how many figures
SHOWN = {"01_your_model": (["training loss after 120 steps", "(4, 64, 32)\nTrue",
                            "verification: True", "'report.html', 'report.json'",
                            '<div class="gatelens-output"><iframe srcdoc="'], 2),
         "02_train_and_analyse": (["{'step': 150, 'val_loss'", "mean forget gate: untrained 0.",
                                   "{0: 0.", ", 75: 0.", ", 150: 0."], 2),
         "03_models_from_elsewhere": (["{'/LSTM': 'LSTM'}", "hf-mamba verified: True",
                                       "'lstm': 'nn.LSTM'"], 0),
         "04_perturbation_split": (["lstm    measured t½", "mingru  measured t½", ", 0.0)"], 1),
         "05_interventions": (["attribution vs patching: Spearman", "lag   cut run",
                               "KL at the ablated step", "rise: [("], 1),
         "06_mamba_beside_lstm": (["lstm      keep gate 'f'", "hf-mamba  keep gate 'a'",
                                   "'hf-mamba': ('hf-mamba', 'a', True)"], 1)}

CHECKS = {"01_your_model": _check_your_model, "02_train_and_analyse": _check_train,
          "03_models_from_elsewhere": _check_elsewhere, "04_perturbation_split": _check_split,
          "05_interventions": _check_interventions, "06_mamba_beside_lstm": _check_mamba}


def test_cells_and_page() -> None:
    text = ("# ---\n# jupyter: {}\n# ---\n\n# %% [markdown]\n# # A title\n#\n# Some *prose*.\n"
            "\n# %%\nx = 1\n\n\n# %% tags=['x']\ny = x + 1\ny\n\n# %%\n\n")
    assert [(c.kind, c.source) for c in hook.cells(text)] == [
        ("markdown", "# A title\n\nSome *prose*."), ("code", "x = 1"), ("code", "y = x + 1\ny")]
    assert hook.title(text) == "A title"
    page = hook.to_markdown(text, "01_x.py")
    assert page.startswith("# A title\n\nSome *prose*.\n\n*A notebook")
    assert "[`01_x.py`](01_x.py)" in page and page.count("```python\n") == 2
    assert "```text" not in page and "outputs below" not in page  # no run, no outputs
    with pytest.raises(ValueError, match="Title"):
        hook.title("# %%\nx = 1\n")


def test_a_failing_cell_names_its_notebook_and_cell(tmp_path: Path) -> None:
    nb = tmp_path / "09_bad.py"
    nb.write_text("# %% [markdown]\n# # Bad\n\n# %%\nx = 1\n\n# %%\n1 / (x - 1)\n", "utf-8")
    with pytest.raises(ZeroDivisionError) as err:
        run_cells(nb)
    assert err.traceback[-1].path == Path("09_bad.py:cell1") or \
        "09_bad.py:cell1" in str(err.traceback[-1].path)


def test_outputs_are_what_jupyter_shows(agg: Path) -> None:
    nb = agg / "09_out.py"
    nb.write_text("# %% [markdown]\n# # Out\n\n# %%\nimport sys\n"
                  "import matplotlib.pyplot as plt\nprint('hello')\nprint('oops', file=sys.stderr)"
                  "\nplt.plot([1, 2])\n6 * 7\n\n"
                  "# %%\nclass Page:\n    def _repr_html_(self):\n        return '<b>rich</b>'\n"
                  "Page()\n\n# %%\nx = 1\n\n# %%\nprint('\\n'.join(map(str, range(100))))\n\n"
                  "# %%\nclass Big:\n    def _repr_html_(self):\n        return 'x' * 10**6\n"
                  "    def __repr__(self):\n        return 'Big()'\nBig()\n",
                  "utf-8")
    ns, outputs = run_cells(nb)
    assert ns["_"].__class__.__name__ == "Big" and ns["x"] == 1
    assert [o.text for o in outputs[:3]] == ["hello\noops\n42\n", "", ""]
    assert outputs[1].html == "<b>rich</b>" and [len(o.figures) for o in outputs] == [1, 0, 0, 0, 0]
    assert outputs[4] == hook.Output("Big()\n", "", [])  # too big to embed: its repr
    assert outputs[0].figures[0].startswith(b"\x89PNG") and not plt_open()
    page = hook.to_markdown(nb.read_text("utf-8"), nb.name, outputs)
    assert "```text\nhello\noops\n42\n```" in page and "outputs below" in page
    assert '<div class="gatelens-output"><b>rich</b></div>' in page
    assert page.count('<img alt="a figure of this cell" src="data:image/png;base64,') == 1
    assert f"\n{hook.MAX_LINES - 1}\n… ({100 - hook.MAX_LINES} more lines)\n```" in page
    with pytest.raises(StopIteration):  # one output per code cell, no fewer
        hook.to_markdown(nb.read_text("utf-8"), nb.name, outputs[:2])


def plt_open() -> list[int]:
    import matplotlib.pyplot as plt

    return plt.get_fignums()


def test_an_empty_rich_display_fails(tmp_path: Path) -> None:
    nb = tmp_path / "09_empty.py"
    nb.write_text("# %%\nclass P:\n    def _repr_html_(self):\n        return ''\nP()\n", "utf-8")
    with pytest.raises(AssertionError, match="09_empty.py:cell0: an empty _repr_html_"):
        run_cells(nb)


def test_every_notebook_has_a_title_and_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text("utf-8")
    for nb in NOTEBOOKS:
        hook.title(nb.read_text("utf-8"))
        assert f"{hook.PAGES}/{nb.stem}.md" in nav, nb.name
