"""No code of the service reads a range of etcd without a bound (a look at the source).

gRPC caps a reply at 4 MiB and history has none: a read of a whole prefix works in a test
and fails in production. The KeyValue seam offers only bounded reads
(get_range with a limit, scan_prefix in pages, count_prefix); this keeps anyone from going
around it, to aetcd's own unbounded calls or a RangeRequest without a limit.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("service", "worker", "bench") for p in sorted((REPO / d).rglob("*.py"))]
UNBOUNDED = {"get_prefix", "get_all"}  # aetcd's whole-range reads (and the seam's old one)


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            yield node, name, {k.arg for k in node.keywords}


def offenders() -> list[str]:
    out = []
    for path in SOURCES:
        where = path.relative_to(REPO)
        for node, name, keywords in _calls(path):
            if name in UNBOUNDED:
                out.append(f"{where}:{node.lineno}: {name}() reads a whole range")
            elif name == "get_range" and "limit" not in keywords:
                out.append(f"{where}:{node.lineno}: get_range() without limit=")
            elif name == "RangeRequest" and not keywords & {"limit", "count_only"}:
                out.append(f"{where}:{node.lineno}: RangeRequest without limit= or count_only=")
    return out


def test_every_range_read_of_the_service_is_bounded():
    assert SOURCES and offenders() == []


def test_the_check_finds_an_unbounded_read(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("async def f(kv, c, rpc):\n"
                   "    await kv.get_prefix('/jobs/')\n"
                   "    await kv.get_range('/jobs/')\n"
                   "    rpc.RangeRequest(key=b'/jobs/', range_end=b'/jobs0')\n"
                   "    await kv.get_range('/jobs/', limit=16)\n")
    monkeypatch.setattr("tests.service.test_bounded_reads.SOURCES", [bad])
    monkeypatch.setattr("tests.service.test_bounded_reads.REPO", tmp_path)
    assert sorted(line.split(": ", 1)[0] for line in offenders()) == ["bad.py:2", "bad.py:3", "bad.py:4"]
