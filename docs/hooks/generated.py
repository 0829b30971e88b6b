"""MkDocs hook: pages generated from the code, so they cannot drift from it.

``<!-- gatelens:cli -->`` becomes the ``--help`` of ``gatelens`` and of every subcommand
(from ``gatelens.cli.build_parser``); ``<!-- gatelens:families -->`` becomes the table of
``gatelens.families()`` (the family registry).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

CLI = "<!-- gatelens:cli -->"
FAMILIES = "<!-- gatelens:families -->"


def cli_markdown() -> str:
    """Every command's --help as a Markdown section of fenced text."""
    from gatelens.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")  # argparse wraps at the terminal's width
    parser = build_parser()
    parts = ["## gatelens", "", "```text", parser.format_help().rstrip(), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        parts += [f"## gatelens {name}", "", "```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def families_markdown() -> str:
    """The family registry as a Markdown table."""
    import gatelens

    rows = ["| family | opens |", "| --- | --- |"]
    rows += [f"| `{name}` | {what} |" for name, what in gatelens.families().items()]
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Fill the markers of a page (MkDocs calls this for every page)."""
    if CLI in markdown:
        markdown = markdown.replace(CLI, cli_markdown())
    if FAMILIES in markdown:
        markdown = markdown.replace(FAMILIES, families_markdown())
    return markdown
