"""Session-wide test settings for running the suite on few cores (issue 35).

* Under pytest-xdist (`-n 2` in pyproject's addopts) each worker process computes with
  one thread: two workers with torch's default of one thread per core would oversubscribe
  the cores, and the tiny models gain nothing from intra-op threads.
* A test that starts a process group of its own (spawned ranks, torchrun) joins the xdist
  group "ranks", so that `--dist loadgroup` runs such tests one after another on one
  worker: two groups of 2-3 ranks at once on 2 cores would oversubscribe them and stretch
  each rank's waits towards its process-group timeout. Which tests do is read from the
  test function's source (the spawn helpers it calls), so a new multi-process test is
  grouped without a marker to forget.
* With the `interpret` marker selected (`pytest -m interpret`), Triton's interpreter has
  to be on before the first test module is imported: with fla installed, Hugging Face's
  model modules (imported by many test modules) import fla, and fla decorates its kernels
  when it is imported, compiled or interpreted for good. `tests/ops/interpret.py` sets it.
  Any other selection leaves the environment alone (a GPU run keeps its compiled kernels).
"""

from __future__ import annotations

import inspect
import os

import pytest

SPAWNS = ("mp.spawn(", "spawn_each(", "_run_each(", "_spawn(", "_spawn_checkpoint_job(", "torchrun",
          "torch.distributed.run", "start_processes(", "_spawn_ranks(", "_launch(", "_start(")
"""Calls that start ranks of a process group, as the tests spell them."""


def pytest_configure(config):
    expr = config.getoption("markexpr", "") or ""
    if "interpret" in expr and "not interpret" not in expr:
        import tests.ops.interpret  # noqa: F401  sets TRITON_INTERPRET=1
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def _starts_ranks(fn, depth: int = 3) -> bool:
    """True when `fn`'s source, or that of a test-package function it calls (`depth`
    levels down), starts ranks."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    if any(call in source for call in SPAWNS):
        return True
    if depth == 0:
        return False
    called = (fn.__globals__.get(name) for name in fn.__code__.co_names)
    return any(inspect.isfunction(g) and g.__module__.startswith("tests") and g is not fn
               and _starts_ranks(g, depth - 1) for g in called)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if isinstance(item, pytest.Function) and _starts_ranks(item.function):
            item.add_marker(pytest.mark.xdist_group("ranks"))
