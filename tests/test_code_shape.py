"""Functions stay short: none in the non-test code (:data:`PACKAGES`) grows past
:data:`MAX_LINES` lines, except the ones still to split, listed below (issues 25 and 38).

The list must equal what is found: it fails when a function grows past the limit and when
one on the list is split (then strike it off), so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Longest function, from its ``def`` line to its last line (decorators not counted).
MAX_LINES = 60
#: Searched: every folder of non-test Python code; generated protobuf code left out.
PACKAGES = ("scheduler_service", "engine_adapter", "clients", "benchmarks", "tools")
GENERATED = "scheduler_service/gen/"

#: Still to split: ``path:qualified name`` (none left: a function that grows past the limit fails).
STILL_TO_SPLIT: set[str] = set()


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, nested ones too, with its qualified name."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    todo: list[tuple[ast.AST, str]] = [(tree, "")]
    while todo:
        node, prefix = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    out.append((name, child))
                todo.append((child, name + "."))
            else:
                todo.append((child, prefix))
    return out


def long_functions(max_lines: int = MAX_LINES) -> dict[str, int]:
    """``path:qualified name`` -> lines, for every function longer than ``max_lines``."""
    found: dict[str, int] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(GENERATED):
                continue
            for name, fn in _functions(ast.parse(path.read_text())):
                n = (fn.end_lineno or fn.lineno) - fn.lineno + 1
                if n > max_lines:
                    found[f"{rel}:{name}"] = n
    return found


def test_long_functions_are_the_listed_ones() -> None:
    found = long_functions()
    grown = {k: v for k, v in found.items() if k not in STILL_TO_SPLIT}
    split = sorted(STILL_TO_SPLIT - set(found))
    assert not grown, f"functions over {MAX_LINES} lines (split them into named helpers): {grown}"
    assert not split, f"no longer over {MAX_LINES} lines: strike them off STILL_TO_SPLIT: {split}"


def test_every_folder_of_code_is_searched() -> None:
    """A new top-level folder of Python code joins :data:`PACKAGES` (the rule is for all of it)."""
    folders = {p.relative_to(ROOT).parts[0] for p in ROOT.glob("*/*.py")} - {"tests"}
    assert folders <= set(PACKAGES), f"add to PACKAGES: {sorted(folders - set(PACKAGES))}"


def test_the_search_finds_nested_functions_and_methods() -> None:
    body = "\n".join(f"            x{i} = {i}" for i in range(MAX_LINES))
    tree = ast.parse(f"class A:\n    def f(self):\n        def g():\n{body}\n        return g\n")
    lines = {name: fn.end_lineno - fn.lineno + 1 for name, fn in _functions(tree) if fn.end_lineno}
    assert lines == {"A.f": MAX_LINES + 3, "A.f.g": MAX_LINES + 1}
