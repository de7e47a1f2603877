"""The import graph of ftrain's own modules (read from their source, not imported): no circle
(two modules that import each other, or a longer loop), and no benchmark imports the tests'
helpers (bench/harness.py is theirs)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "worker", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules (and packages outside this set) `path` imports anywhere: at module
    level, in a function, or for type checking only (such an import is still a circle)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    paths = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def a_circle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `g` (its modules in order, the first one again at the end), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done or module not in g:
            return None
        for dep in sorted(g[module]):
            if (found := visit(dep, path + [module])) is not None:
                return found
        done.add(module)
        return None

    return next((c for m in sorted(g) if (c := visit(m, [])) is not None), None)


def test_the_circle_finder_finds_one():
    assert a_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert a_circle({"a": {"b"}, "b": {"os"}}) is None


def test_no_modules_import_each_other_round_a_circle():
    assert a_circle(graph()) is None


def test_no_benchmark_imports_the_tests():
    g = graph()
    offenders = sorted((m, d) for m, deps in g.items() if m.startswith("bench.")
                       for d in deps if d == "tests" or d.startswith("tests."))
    assert offenders == []
