"""Every report in the unit the model reads (docs/methods.md "Tokens and depth").

gatelens's own sentences, labels and headings are written once, for characters (the seed's
unit); ``in_unit`` puts them in the model's unit (report.json ``model.unit``: characters,
tokens or bytes). It is applied to gatelens's words only, never to what a user named (a
module path, a text's source, a token).

>>> in_unit("a difference halves every 3 characters (λ = -0.2 nats per character)", "tokens")
'a difference halves every 3 tokens (λ = -0.2 nats per token)'
>>> in_unit("KL of next-character predictions; Gates by input character", "bytes")
'KL of next-byte predictions; Gates by input byte'
>>> in_unit("3 characters", "characters")
'3 characters'
"""

from __future__ import annotations

import re

UNITS = {"characters": "character", "tokens": "token", "bytes": "byte"}  # plural: singular
_WORD = re.compile(r"\b([Cc])haracter(s?)\b")


def unit_of(report: dict) -> str:
    """The unit a report.json speaks of (a report written before units: characters)."""
    return (report.get("model") or {}).get("unit") or "characters"


def in_unit(text: str, unit: str) -> str:
    """``text`` (gatelens's own words, in characters) in ``unit``."""
    if unit == "characters" or unit not in UNITS:
        return text
    singular = UNITS[unit]

    def swap(m: re.Match) -> str:
        word = singular + ("s" if m.group(2) else "")
        return word.capitalize() if m.group(1) == "C" else word

    return _WORD.sub(swap, text)


def report_in_unit(node: object, unit: str) -> object:
    """report.json's own sentences (every "description" and "explanation") in ``unit``."""
    if unit == "characters":
        return node
    if isinstance(node, dict):
        return {k: in_unit(v, unit) if k in ("description", "explanation") and
                isinstance(v, str) else report_in_unit(v, unit) for k, v in node.items()}
    if isinstance(node, list):
        return [report_in_unit(v, unit) for v in node]
    return node
