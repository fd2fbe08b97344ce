"""The README's Python blocks run as pasted: extracted from the file itself, so a README
that drifts from the code fails here."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs_blocks import blocks, python_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_is_a_front_page():
    assert len(README.read_text().splitlines()) <= 250


def test_python_blocks_finds_each_fence_and_its_no_test_mark(tmp_path):
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n<!-- no-test: needs a GPU -->\n```python\ny = 2\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]
    (tmp_path / "page.md").write_text(text)
    assert [(b.body, b.line, b.skip) for b in blocks(tmp_path / "page.md")] == [("x = 1\n", 3, None),
                                                                               ("y = 2\n", 10, "needs a GPU")]


def test_every_python_block_of_the_readme_runs_as_pasted(capsys):
    blocks = python_blocks(README.read_text())
    assert blocks, "the README has no Python block"
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), {"__name__": f"readme_block_{i}"})
    out = capsys.readouterr().out
    # the first step's printed line: an update ran (a gradient, not only the ~0 loss)
    grad_norm = float(re.search(r"grad norm ([0-9.]+)", out).group(1))
    assert grad_norm > 0
