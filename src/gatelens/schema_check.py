"""The one rule for the JSON files a user can hand back to gatelens (a run's config.json,
a study's trial.json, an analysis's page_data.json): each key a reader relies on has the
type it expects, checked before use, and a wrong one is one line naming the file and the
key (GatelensError, exit 2), never a traceback deep inside.

A field is described by a :data:`Kind`: ``"int"`` (not a bool), ``"number"`` (int or
float, finite, not a bool), ``"str"``, ``"list"``, ``"dict"``, ``"bool"``, a tuple of
allowed strings, or ``None`` in a tuple of kinds for "may be null".

>>> check_fields({"seed": "x"}, {"seed": ("int",)}, "run/config.json", "train")
Traceback (most recent call last):
...
gatelens.errors.GatelensError: run/config.json: "train.seed" must be an integer, got 'x'
>>> check_fields({"forget_bias": None}, {"forget_bias": ("number", None)}, "c.json", "train")
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from gatelens.errors import GatelensError

__all__ = ["PLACEHOLDER", "Kind", "check_chars", "check_fields", "check_schema", "describe",
           "is_kind"]

#: a field's kind: a name below, None (null allowed), or a tuple of allowed strings
Kind = str | None | tuple[str, ...]

_WORDS = {"int": "an integer", "number": "a finite number", "str": "a string",
          "list": "a list", "dict": "an object", "bool": "true or false"}


def is_kind(value: Any, kind: Kind) -> bool:
    """Whether ``value`` is of ``kind`` (the module docstring's names).

    >>> is_kind(True, "int"), is_kind(2.0, "number"), is_kind(float("nan"), "number")
    (False, True, False)
    """
    if kind is None:
        return value is None
    if isinstance(kind, tuple):  # one of these strings
        return isinstance(value, str) and value in kind
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value))
    return isinstance(value, {"str": str, "list": list, "dict": dict, "bool": bool}[kind])


def describe(kinds: tuple[Kind, ...]) -> str:
    """Words for what a field may be.

    >>> describe(("number", None)), describe((("adam", "sgd"),))
    ('a finite number or null', 'one of "adam", "sgd"')
    """
    words = []
    for k in kinds:
        if k is None:
            words.append("null")
        elif isinstance(k, tuple):
            words.append("one of " + ", ".join(f'"{s}"' for s in k))
        else:
            words.append(_WORDS[k])
    return " or ".join(words)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fields(data: Mapping[str, Any], fields: Mapping[str, tuple[Kind, ...]],
                 path: object, block: str | None = None, *,
                 required: tuple[str, ...] = ()) -> None:
    """Every key of ``fields`` that ``data`` holds (and each of ``required``, which it must
    hold) of one of its kinds; else GatelensError ``PATH: "block.key" must be ...``."""
    for key, kinds in fields.items():
        name = f"{block}.{key}" if block else key
        if key not in data:
            if key in required:
                raise GatelensError(f'{path}: "{name}" is missing')
            continue
        if not any(is_kind(data[key], k) for k in kinds):
            raise GatelensError(f'{path}: "{name}" must be {describe(kinds)}, got '
                                f"{_shown(data[key])}")


#: gatelens's own names for rows no character names (``<unused 10>``, ``<7>``)
PLACEHOLDER = re.compile(r"<(unused )?\d+>")


def check_chars(chars: object, where: str, placeholders: bool = False) -> list[str]:
    """A character vocabulary (index order): a non-empty list of distinct single
    characters. The one rule of ``Lens(vocab=)``, ``--vocab`` files and config.json;
    ``placeholders`` also lets gatelens's names of unnamed rows through (``<unused 10>``:
    a weights file's rows its vocabulary does not name).

    >>> check_chars(["a", "b"], "vocab")
    ['a', 'b']
    >>> check_chars(["a", 5], "vocab")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: vocab: entry 1 is 5, not a single character
    """
    if isinstance(chars, str) or not isinstance(chars, list | tuple) or not chars:
        raise GatelensError(f"{where}: expected a non-empty list of characters, got "
                            f"{_shown(chars)}")
    seen: dict[str, int] = {}
    for i, c in enumerate(chars):
        if not isinstance(c, str) or (len(c) != 1 and not (
                placeholders and PLACEHOLDER.fullmatch(c))):
            raise GatelensError(f"{where}: entry {i} is {_shown(c)}, not a single character")
        if c in seen:
            raise GatelensError(f"{where}: character {c!r} appears twice (entries {seen[c]} "
                                f"and {i})")
        seen[c] = i
    return list(chars)


#: JSON Schema's type names in the words of ``_WORDS`` ("integer" a Python int, "number"
#: a finite int or float: gatelens writes no NaN)
_JSON_TYPES = {"integer": "int", "number": "number", "string": "str", "array": "list",
               "object": "dict", "boolean": "bool", "null": None}


def check_schema(value: Any, schema: Mapping[str, Any], where: object) -> None:
    """``value`` against a JSON Schema (the subset gatelens's own schemas use: type, enum,
    $ref into $defs, oneOf/anyOf, properties, required, additionalProperties,
    patternProperties, items, minItems, maxItems, minimum, maximum, exclusiveMinimum);
    the first problem is one GatelensError naming ``where`` and the key's dotted path.

    >>> s = {"type": "object", "required": ["lags"], "properties": {"lags": {
    ...     "type": "array", "items": {"type": "integer", "minimum": 1}}}}
    >>> check_schema({"lags": [1, 2]}, s, "report.json")
    >>> check_schema({"lags": [1, 0]}, s, "report.json")
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: report.json: "lags[1]" must be at least 1, got 0
    """
    problem = _problem(value, schema, schema, "")
    if problem is not None:
        path, text = problem
        raise GatelensError(f'{where}: "{path or "(the whole file)"}" {text}')


def _problem(v: Any, s: Mapping[str, Any], root: Mapping[str, Any],
             path: str) -> tuple[str, str] | None:
    """(dotted path, what is wrong) of the first place ``v`` breaks ``s``, or None."""
    if "$ref" in s:
        ref = s["$ref"]
        target: Any = root
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        found = _problem(v, target, root, path)
        if found is not None:
            return found
    branches = s.get("oneOf") or s.get("anyOf")
    if branches:
        found = [_problem(v, b, root, path) for b in branches]
        if all(f is not None for f in found):  # the deepest complaint says the most
            return max(found, key=lambda f: len(f[0]))  # type: ignore[arg-type, return-value]
    if "type" in s:
        types = [s["type"]] if isinstance(s["type"], str) else list(s["type"])
        kinds = [_JSON_TYPES[t] for t in types]
        if not any(is_kind(v, k) for k in kinds):
            return path, f"must be {describe(tuple(kinds))}, got {_shown(v)}"
    if "enum" in s and not any(type(v) is type(e) and v == e for e in s["enum"]):
        return path, f"must be one of {', '.join(json_word(e) for e in s['enum'])}, got " \
                     f"{_shown(v)}"
    if is_kind(v, "number"):
        for key, ok, word in (("minimum", lambda b: v >= b, "at least"),
                              ("maximum", lambda b: v <= b, "at most"),
                              ("exclusiveMinimum", lambda b: v > b, "above")):
            if key in s and not ok(s[key]):
                return path, f"must be {word} {s[key]}, got {_shown(v)}"
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", len(v)):
            return path, f"has {len(v)} items, outside {s.get('minItems', 0)}.." \
                         f"{s.get('maxItems', '')}"
        if isinstance(s.get("items"), Mapping):
            for i, item in enumerate(v):
                found = _problem(item, s["items"], root, f"{path}[{i}]")
                if found is not None:
                    return found
    if isinstance(v, dict):
        for key in s.get("required", ()):
            if key not in v:
                return _join(path, key), "is missing"
        props, extra = s.get("properties", {}), s.get("additionalProperties", True)
        patterns = s.get("patternProperties", {})
        for key, item in v.items():
            sub = props.get(key) or next((p for pat, p in patterns.items()
                                          if re.search(pat, key)), None)
            if sub is None and extra is False:
                return _join(path, key), "is not a key of this file"
            sub = sub if sub is not None else extra if isinstance(extra, Mapping) else None
            if sub is not None:
                found = _problem(item, sub, root, _join(path, key))
                if found is not None:
                    return found
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def json_word(value: Any) -> str:
    """A JSON value as JSON writes it (``null``, ``"f"``)."""
    import json

    return json.dumps(value)
