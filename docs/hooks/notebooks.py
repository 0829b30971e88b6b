"""MkDocs hook: the notebooks under notebooks/ as Tutorials pages, generated at build time.

The notebooks are jupytext "percent" files (``notebooks/NN_name.py``): a cell starts at a
line ``# %%`` (code) or ``# %% [markdown]`` (prose, every line a ``# `` comment), and a
header ``# ---`` … ``# ---`` holds jupytext's metadata. ``jupytext --to notebook`` (or
opening the file in Jupyter with jupytext installed) makes an .ipynb of it; the test suite
runs its cells in order with ``run_cells`` (tests/test_notebooks.py).

Each notebook becomes ``tutorials/NN_name.md``: its prose as Markdown and its code as
```python blocks, with a line naming the file to run. The pages exist only in the built
site, never under docs/, so the notebook stays their one source.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

CELL = re.compile(r"^# %%(?P<kind> \[markdown\])?[^\n]*$", re.M)
PAGES = "tutorials"


class Cell(NamedTuple):
    """One notebook cell: "code" or "markdown", and its source (comment marks removed
    from markdown)."""

    kind: str
    source: str


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


def to_markdown(text: str, source: str) -> str:
    """The notebook as a Markdown page: prose as it is, code cells fenced as python."""
    parts: list[str] = []
    for i, c in enumerate(cells(text)):
        if c.kind == "markdown":
            parts.append(c.source)
            if i == 0:
                parts.append(f"*A notebook that runs in the test suite: `{source}` (open it "
                             "in Jupyter with jupytext, or run it with `python`).*")
        else:
            parts.append(f"```python\n{c.source}\n```")
    return "\n\n".join(parts) + "\n"


def notebooks(root: Path) -> list[Path]:
    """notebooks/*.py under ``root``, in name order."""
    return sorted((root / "notebooks").glob("[0-9]*.py"))


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add one generated page per notebook (MkDocs calls this before building the nav)."""
    from mkdocs.structure.files import File

    root = Path(config.config_file_path).parent
    for nb in notebooks(root):
        text = nb.read_text(encoding="utf-8")
        files.append(File.generated(config, f"{PAGES}/{nb.stem}.md",
                                    content=to_markdown(text, f"notebooks/{nb.name}")))
    return files
