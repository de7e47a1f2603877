"""Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file that exists,
and every `#anchor` at a heading of the page it names (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes for a page's headings."""
    text = FENCE.sub("", page.read_text())
    found = set()
    for heading in re.findall(r"^#+\s+(.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_at_an_existing_file_and_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


# How the project was built is git's to say, not the product's: no tracked file names its
# work items, work periods or the machines lent to measure it.
NARRATION = re.compile(r"\b[Ii]ssue \d+\b|\b[Ss]top \d+\b|\bfinal code\b|\bnvidia-h[12]00-x\d\b")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".js", ".html", ".css", ".sh", ".txt", ".json", ""}


PRODUCT = ["service", "worker", "ftrain", "tests", "docs", "bench", "examples", "docker", "deploy", ".ci"]
TOP_FILES = ["README.md", "CHANGELOG.md", "Makefile", "pyproject.toml"]


def product_files() -> list[Path]:
    out = [REPO / f for f in TOP_FILES]
    for top in PRODUCT:
        out += [p for p in (REPO / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                and "vendor" not in p.parts and p.suffix in TEXT_SUFFIXES]
    return out


def test_no_product_file_narrates_how_the_project_was_built():
    found = []
    for path in product_files():
        if path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if NARRATION.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
