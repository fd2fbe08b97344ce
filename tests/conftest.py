"""Session-wide test settings for running the suite on few cores (issue 35).

* Under pytest-xdist (`-n 2` in pyproject's addopts) each worker process computes with
  one thread: two workers with torch's default of one thread per core would oversubscribe
  the cores, and the tiny models gain nothing from intra-op threads.
* Tests that start ranks of their own (spawned from `tests/ranks.py`'s preloaded fork
  server, or torchrun) are scheduled like any other test. (An earlier version ran them one
  after another on one worker, which made their sum, most of the suite's time, the
  critical path; each rank computes with one thread, and the process groups' timeouts are
  minutes, far above any wait two groups at once cause on 2 cores.)
* With the `interpret` marker selected (`pytest -m interpret`), Triton's interpreter has
  to be on before the first test module is imported: with fla installed, Hugging Face's
  model modules (imported by many test modules) import fla, and fla decorates its kernels
  when it is imported, compiled or interpreted for good. `tests/ops/interpret.py` sets it.
  Any other selection leaves the environment alone (a GPU run keeps its compiled kernels).
"""

from __future__ import annotations

import os


def pytest_configure(config):
    expr = config.getoption("markexpr", "") or ""
    if "interpret" in expr and "not interpret" not in expr:
        import tests.ops.interpret  # noqa: F401  sets TRITON_INTERPRET=1
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
