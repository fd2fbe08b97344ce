"""The Python blocks of a Markdown page, as pasted (the README's and every docs/*.md page's
tests read them from the files, so a page that drifts from the code fails).

A block preceded by an HTML comment `<!-- no-test: REASON -->` (e.g. "needs a GPU", "needs
a cluster") is listed with that reason and not run. The blocks of one page run in order in
one namespace, as a reader pastes them one after another into one session.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?:<!--\s*no-test:\s*(?P<reason>.*?)\s*-->\s*\n)?```python\n(?P<body>.*?)^```", re.S | re.M)


@dataclass
class Block:
    """One ```python fence: its body, the line its body starts on, and why it is not run (None: it is)."""

    body: str
    line: int
    skip: str | None = None


def blocks(path) -> list[Block]:
    """Every ```python block of the Markdown file at `path`, in order."""
    text = Path(path).read_text()
    return [Block(m.group("body"), text.count("\n", 0, m.start("body")) + 1, m.group("reason"))
            for m in FENCE.finditer(text)]


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fences of a Markdown text, in order (marked ones too)."""
    return [m.group("body") for m in FENCE.finditer(text)]


def run_blocks(path, namespace: dict | None = None) -> dict:
    """Run the page's blocks that are not marked, in order, in one namespace; a failure
    names the page and the block's first line. Returns the namespace."""
    namespace = {"__name__": f"docs_{Path(path).stem}"} if namespace is None else namespace
    for block in blocks(path):
        if block.skip is None:
            exec(compile("\n" * (block.line - 1) + block.body, str(path), "exec"), namespace)
    return namespace
