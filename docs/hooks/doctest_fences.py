"""Griffe extension for the API pages: doctest examples in docstrings become code blocks.

gatelens's docstrings hold plain ``>>>`` examples (run by pytest's doctest). As Markdown a
``>>>`` line is a nested block quote and an output such as ``['a', 'b'][0]`` reads as a
link, so each example (its ``>>>`` and ``...`` lines and the output up to a blank line) is
wrapped in a ``pycon`` fence before mkdocstrings renders it.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with every doctest example in a ```` ```pycon ```` fence.

    >>> print(fence_doctests("Adds.\\n\\n>>> 1 + 1\\n2\\n\\nDone."))
    Adds.
    <BLANKLINE>
    ```pycon
    >>> 1 + 1
    2
    ```
    <BLANKLINE>
    Done.
    """
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if not inside and line.lstrip().startswith(">>>"):
            inside = True
            out.append(line[: len(line) - len(line.lstrip())] + "```pycon")
        elif inside and not line.strip():
            inside = False
            out.append("```")
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Wraps the doctest examples of every object's docstring (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring before it is parsed."""
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
