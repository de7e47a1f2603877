"""worker/ reaches the control plane only through worker/http.py."""

from __future__ import annotations

import ast
from pathlib import Path

import worker

WORKER = Path(worker.__file__).parent
SEAM = WORKER / "http.py"
FORBIDDEN = ("httpx", "httpcore", "urllib.request", "http.client", "requests")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement names, with `from a import b` as both a and a.b."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_only_worker_http_imports_an_http_client():
    offenders = []
    for path in sorted(WORKER.rglob("*.py")):
        if path == SEAM:
            continue
        for line, name in _imports(ast.parse(path.read_text(), str(path))):
            if _forbidden(name):
                offenders.append(f"{path.relative_to(WORKER.parent)}:{line} imports {name}")
    assert not offenders, ("reach the control plane through worker/http.py:\n" + "\n".join(offenders))


def test_the_check_sees_every_spelling_of_an_import():
    source = ("import httpx\nimport urllib.request as r\nfrom urllib import request\n"
              "from http import client\nimport requests.adapters\nfrom urllib.parse import quote\n")
    names = [name for _, name in _imports(ast.parse(source)) if _forbidden(name)]
    assert names == ["httpx", "urllib.request", "urllib.request", "http.client", "requests.adapters"]


def test_the_seam_itself_is_where_httpx_is_imported():
    assert ("httpx" in [name for _, name in _imports(ast.parse(SEAM.read_text()))])
