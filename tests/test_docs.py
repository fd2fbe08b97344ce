"""The docs site's source: mkdocs.yml's nav lists every page under docs/, and no page links
outside the repository except to public web sites (`mkdocs build --strict`, in .ci/run,
checks that every link inside resolves)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)|(?:href|src)=\"([^\"]+)\"")
"""A markdown link or image target, or an HTML href/src."""


def nav_pages(nav) -> list[str]:
    """Every page file in an mkdocs nav (nested lists of {title: page or sub-nav})."""
    pages = []
    for item in nav:
        entries = item.values() if isinstance(item, dict) else [item]
        for entry in entries:
            pages += nav_pages(entry) if isinstance(entry, list) else [entry]
    return pages


def outside_links(text: str, page: Path) -> list[str]:
    """The link targets of `text` (the page at `page`) that leave the repository: a relative
    path resolving above ROOT, an absolute path, or a non-web scheme (file:, ...)."""
    bad = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"https?://|mailto:|#", target):
            continue
        if ":" in target.split("/")[0] or target.startswith("/"):
            bad.append(target)
            continue
        resolved = (page.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(ROOT):
            bad.append(target)
    return bad


def test_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(nav_pages(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - listed == set(), "docs pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries with no page"


def test_no_page_links_outside_the_repository():
    bad = {}
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        found = outside_links(text, page) + re.findall(r"\.\./shared/\S+", text)
        if found:
            bad[str(page.relative_to(ROOT))] = found
    assert bad == {}


def test_outside_links_flags_what_leaves():
    page = DOCS / "planner.md"
    text = "[a](../../shared/DESIGN.md) [b](https://example.org) [c](api.md#engine) [d](file:///etc) [e](/abs)"
    assert outside_links(text, page) == ["../../shared/DESIGN.md", "file:///etc", "/abs"]
