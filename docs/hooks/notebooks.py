"""MkDocs hook: the notebooks under docs/tutorials/ as Tutorials pages, generated at build time.

The notebooks are jupytext "percent" files (``docs/tutorials/NN_name.py``): a cell starts at
a line ``# %%`` (code) or ``# %% [markdown]`` (prose, every line a ``# `` comment), and a
header ``# ---`` … ``# ---`` holds jupytext's metadata. ``jupytext --to notebook`` (or
opening the file in Jupyter with jupytext installed) makes an .ipynb of it; the test suite
runs its cells in order with ``run_cells`` (tests/test_notebooks.py), the function the site
build runs them with.

Each notebook becomes ``tutorials/NN_name.md``: its prose as Markdown, its code as
```python blocks, each followed by what the cell showed (its printed text, its last
expression, its figures) and a link to the file to run. The pages exist only in the built
site, never under docs/, so the notebook stays their one source. The build runs every
notebook (about half a minute of CPU in all); ``GATELENS_DOCS_RUN_TUTORIALS=0`` builds the
pages with code and prose only (the test suite's site build does, as tests/test_notebooks.py
runs them).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

CELL = re.compile(r"^# %%(?P<kind> \[markdown\])?[^\n]*$", re.M)
PAGES = "tutorials"
#: where the notebooks live, under the repository root (docs/design.md, "Documentation")
SOURCES = Path("docs") / PAGES
#: the environment variable that, set to 0, skips running the notebooks in the build
RUN_ENV = "GATELENS_DOCS_RUN_TUTORIALS"
#: a cell's text output is cut after this many lines on the page
MAX_LINES = 40
#: a last expression's HTML (Jupyter's rich display) is shown up to this size, else its repr
MAX_HTML = 400_000


class Cell(NamedTuple):
    """One notebook cell: "code" or "markdown", and its source (comment marks removed
    from markdown)."""

    kind: str
    source: str


class Output(NamedTuple):
    """What one code cell showed: printed text (stdout and stderr, then the repr of its
    last expression, unless that is shown as HTML), the HTML of a last expression that has
    ``_repr_html_`` (up to ``MAX_HTML`` characters), and its figures as PNG bytes."""

    text: str
    html: str
    figures: list[bytes]


def cells(text: str) -> list[Cell]:
    """The cells of a percent-format notebook, in order; empty cells are dropped.

    >>> [(c.kind, c.source) for c in cells("# ---\\n# x: 1\\n# ---\\n\\n# %% [markdown]\\n"
    ...                                    "# # Title\\n#\\n# Prose.\\n\\n# %%\\nx = 1\\n")]
    [('markdown', '# Title\\n\\nProse.'), ('code', 'x = 1')]
    """
    text = _drop_header(text)
    marks = list(CELL.finditer(text))
    out: list[Cell] = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = text[m.end():end].strip("\n")
        if m.group("kind"):
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#")
                     for line in body.splitlines()]
            out.append(Cell("markdown", "\n".join(lines).strip()))
        else:
            out.append(Cell("code", body.rstrip()))
    return [c for c in out if c.source]


def _drop_header(text: str) -> str:
    """The text after jupytext's ``# ---`` … ``# ---`` header (if it opens the file)."""
    if text.startswith("# ---\n"):
        end = text.find("\n# ---\n", 5)
        if end >= 0:
            return text[end + len("\n# ---\n"):]
    return text


def title(text: str) -> str:
    """The notebook's first Markdown heading (its page title in the nav)."""
    for c in cells(text):
        if c.kind == "markdown":
            for line in c.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise ValueError("a notebook must open with a Markdown cell holding a '# Title'")


def run_cells(path: Path) -> tuple[dict[str, Any], list[Output]]:
    """Execute a notebook's code cells in order in one namespace, as one Jupyter kernel
    would, in the current directory; returns the namespace and each code cell's ``Output``.

    A cell's last expression statement is evaluated and shown as Jupyter shows it: its
    ``_repr_html_`` if it has one (an empty one is an error), and its repr. Figures left
    open by a cell are its figures (saved as PNG, then closed, as Jupyter's inline backend
    does). A failing cell raises with the notebook and cell number as its traceback's file.
    """
    ns: dict[str, Any] = {"__name__": "__main__"}
    outputs: list[Output] = []
    for i, cell in enumerate(c for c in cells(path.read_text("utf-8")) if c.kind == "code"):
        tree = ast.parse(cell.source)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        where = f"{path.name}:cell{i}"
        printed = io.StringIO()
        html = ""
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            exec(compile(tree, where, "exec"), ns)
            value = None
            if last is not None:
                value = eval(compile(ast.Expression(last.value), where, "eval"), ns)
            if hasattr(value, "_repr_html_"):
                html = value._repr_html_()
                if not (isinstance(html, str) and html):
                    raise AssertionError(f"{where}: an empty _repr_html_")
        text = printed.getvalue()
        if value is not None:
            ns["_"] = value
            if not html or len(html) > MAX_HTML:  # else the page shows the HTML, not the repr
                text += repr(value) + "\n"
                html = ""
        outputs.append(Output(text, html, _figures()))
    return ns, outputs


def _figures() -> list[bytes]:
    """The open matplotlib figures as PNG, closed after (none if pyplot is not in use)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=72)
        out.append(buf.getvalue())
        plt.close(fig)
    return out


@contextlib.contextmanager
def sandbox() -> Iterator[Path]:
    """Run inside a new empty directory, with matplotlib's Agg backend and one torch thread
    (a tutorial's small models run several times faster so on a few shared cores); the
    directory, backend and thread count are restored after."""
    import matplotlib.pyplot as plt
    import torch

    here, backend, threads = Path.cwd(), plt.get_backend(), torch.get_num_threads()
    plt.switch_backend("Agg")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="gatelens-tutorial-") as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(here)
            plt.close("all")
            plt.switch_backend(backend)
            torch.set_num_threads(threads)


def to_markdown(text: str, source: str, outputs: list[Output] | None = None) -> str:
    """The notebook as a Markdown page: prose as it is, code cells fenced as python, each
    followed by its output when ``outputs`` (one per code cell, from ``run_cells``) is given.
    ``source`` is the notebook's file name, linked from the page."""
    parts: list[str] = []
    code = iter(outputs) if outputs is not None else None
    for i, c in enumerate(cells(text)):
        if c.kind == "markdown":
            parts.append(c.source)
            if i == 0:
                ran = " The outputs below are from the run that built this page." if code else ""
                parts.append(f"*A notebook that runs in the test suite: [`{source}`]({source}) "
                             "(open it in Jupyter with jupytext, or run it with "
                             f"`python`).{ran}*")
        else:
            parts.append(f"```python\n{c.source}\n```")
            if code is not None:
                parts += _output_markdown(next(code))
    return "\n\n".join(parts) + "\n"


def _output_markdown(out: Output) -> list[str]:
    """One cell's output as Markdown blocks: text fenced, HTML and figures as raw HTML."""
    parts = []
    if out.text.strip():
        lines = out.text.rstrip("\n").splitlines()
        if len(lines) > MAX_LINES:
            lines = lines[:MAX_LINES] + [f"… ({len(lines) - MAX_LINES} more lines)"]
        body = "\n".join(lines).replace("```", "'''")
        parts.append(f"```text\n{body}\n```")
    if out.html:
        parts.append(f'<div class="gatelens-output">{out.html}</div>')
    for png in out.figures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<p><img alt="a figure of this cell" src="data:image/png;base64,{data}"></p>')
    return parts


def notebooks(root: Path) -> list[Path]:
    """docs/tutorials/NN_*.py under the repository ``root``, in name order."""
    return sorted((root / SOURCES).glob("[0-9]*.py"))


def page(nb: Path, run: bool) -> str:
    """The page of notebook ``nb``, with its outputs if ``run`` (it is run in a ``sandbox``)."""
    text = nb.read_text(encoding="utf-8")
    outputs = None
    if run:
        with sandbox():
            _, outputs = run_cells(nb)
    return to_markdown(text, nb.name, outputs)


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add one generated page per notebook (MkDocs calls this before building the nav)."""
    from mkdocs.structure.files import File

    root = Path(config.config_file_path).parent
    run = os.environ.get(RUN_ENV, "1") != "0"
    for nb in notebooks(root):
        files.append(File.generated(config, f"{PAGES}/{nb.stem}.md", content=page(nb, run)))
    return files
