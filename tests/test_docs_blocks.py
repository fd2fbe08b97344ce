"""Every Python block of docs/*.md runs as pasted (tests/docs_blocks.py), page by page in
one namespace, except the blocks marked `<!-- no-test: needs a GPU -->` (or a cluster).
A page whose blocks take more than a few seconds runs under `-m slow`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import blocks, run_blocks

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md") if blocks(p))
SLOW = {"trl.md", "rehearse.md", "rollouts.md", "trees.md", "vision.md"}
"""Pages whose blocks take more than a few seconds (a TRL run, a rehearsal on fake tensors,
episodes, trees and images through generate + exact steps): -m slow. usage.md keeps
generate + step, text and images, in the default suite."""


def test_every_page_with_python_is_listed_and_each_mark_gives_a_reason():
    assert "usage.md" in PAGES and "planner.md" in PAGES
    for page in PAGES:
        for block in blocks(DOCS / page):
            assert block.skip is None or block.skip.strip(), f"{page}:{block.line}: a no-test mark without a reason"


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in PAGES])
def test_the_python_blocks_of_a_docs_page_run_as_pasted(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    run_blocks(DOCS / page)
