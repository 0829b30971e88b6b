"""The package's shape: no import cycle (function-level imports counted), no family
knowledge outside families/ and cells/, no source file over 400 lines (docs/design.md §2, §3).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "gatelens"
#: names of families, cell kinds and packages that only families/ and cells/ may use in code
FAMILY_WORDS = re.compile(
    r"mamba|rwkv|xlstm|mingru|minlstm|slstm|lstmcell|grucell|rnncell|recurrent_?gemma|"
    r"rg_?lru|deltanet|gated_delta|torch_?cell|officialfamily", re.I)


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(path: Path, mod: str, mods: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports anywhere (not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = set()
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = pkg.split(".")[: len(pkg.split(".")) - n.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in n.names]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod:
                found.add(name)
    return found


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(p, m, mods) for m, p in mods.items()}
    # a package's __init__ importing its own submodules is not a cycle of layers
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_family_is_named_outside_families_and_cells():
    leaks = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith(("families/", "cells/")):
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docs = {id(b[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                  ast.ClassDef))
                and (b := n.body) and isinstance(b[0], ast.Expr)
                and isinstance(b[0].value, ast.Constant) and isinstance(b[0].value.value, str)}
        hits = set()
        for n in ast.walk(tree):
            s = None
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                s = n.value
            elif isinstance(n, ast.Name):
                s = n.id
            elif isinstance(n, ast.Attribute):
                s = n.attr
            elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                s = n.name
            elif isinstance(n, ast.alias):
                s = n.name
            if s:
                hits |= {m.group(0).lower() for m in FAMILY_WORDS.finditer(s)}
        if hits:
            leaks[rel] = sorted(hits)
    assert not leaks, leaks


def test_no_source_file_over_400_lines():
    long = {p.relative_to(PKG).as_posix(): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long, long
