"""Starting a test's ranks without paying for the imports each time (issue 35).

`torch.multiprocessing.spawn` starts every rank as a fresh interpreter, which imports
torch, transformers, their model modules and longstraw again: about 6.4 CPU-seconds a
rank on this machine, paid by some 70 spawned groups of 2 or 3 ranks per suite run, most
of the distributed tests' time. `spawn` here starts them with `start_method="forkserver"`
instead: one server per test process imports those modules once (`preload`, before it
has run any computation, so no thread pools or allocations are inherited), and each rank
is a fork of it. A rank still starts with a fresh torch state and no process group.

The server is started once, so a rank would see the environment of that moment, not the
test's: `spawn` hands each rank the caller's `os.environ` as it is at the call
(`monkeypatch.setenv` before spawning keeps working).
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch.multiprocessing as mp

WORLDS = [pytest.param(2, marks=pytest.mark.slow), 3]
"""The world sizes of a context-parallel equality test: W = 3 by default, for it has what
W = 2 has (a rank's shard cut by blocks and chunks, a relay across ranks) and more (a
middle rank, a rank whose shard holds no whole block); W = 2 repeats it in `-m slow`."""

PRELOAD = ["tests.ranks_preload"]
"""Modules the fork server imports once: see `tests/ranks_preload.py`."""


def _rank_main(rank: int, env: dict[str, str], fn, *args) -> None:
    _call_with_env(env, fn, (rank, *args))


def spawn(fn, args: tuple = (), nprocs: int = 1, join: bool = True):
    """`torch.multiprocessing.spawn(fn, args, nprocs, join)` with ranks forked from a
    preloaded server. Same contract: `fn(rank, *args)` in each, a rank's exception raised
    here as `ProcessRaisedException`, a dead rank as `ProcessExitedException`; with
    `join=False` the `ProcessContext`."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return mp.start_processes(_rank_main, args=(dict(os.environ), fn, *args), nprocs=nprocs, join=join,
                              start_method="forkserver")


def run_fresh(fn, *args):
    """`fn(*args)` in a new process forked from the preloaded server, its result returned:
    a process with no history of allocations (for the live-tensor peaks of
    `tests/test_plan_live.py`), without a fresh interpreter's imports."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_call_with_env, (dict(os.environ), fn, args))


def _call_with_env(env: dict[str, str], fn, args: tuple):
    """`fn(*args)` with the environment the caller had when it started this process."""
    os.environ.clear()
    os.environ.update(env)
    return fn(*args)
