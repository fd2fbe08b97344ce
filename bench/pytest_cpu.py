"""A pytest plugin: the CPU seconds of each test, its spawned ranks included, one row per
test appended to $CPU_LOG (default bench/results/test_cpu.txt) as "seconds nodeid".

On a machine that other jobs load, a test's wall time says more about the load than about
the test (2-10x on 2 shared cores); its CPU time does not. The ranks `tests/ranks.spawn`
starts are children of its preloaded fork server, which reaps them: their time shows in
the server's cutime/cstime (/proc/PID/stat), not in pytest's own children's rusage, so
both are summed. The first spawning test of a run also pays the server's imports (~5 s).

    CPU_LOG=out.txt OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/bench python -m pytest -q -n 0 -p pytest_cpu tests/...

OMP_NUM_THREADS=1 as under xdist (`tests/conftest.py` sets one thread per worker): with
two threads on loaded cores the in-process tests run up to 5x slower than in the suite.
"""

from __future__ import annotations

import os
import resource

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _fork_server_cpu() -> float:
    """utime + stime + cutime + cstime of the fork server (0 when none was started)."""
    try:
        from multiprocessing import forkserver

        pid = forkserver._forkserver._forkserver_pid
        if not pid:
            return 0.0
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / _TICK
    except (OSError, AttributeError, ValueError):
        return 0.0


def cpu_seconds() -> float:
    """This process's CPU seconds, its reaped children's and the fork server's."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _fork_server_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = cpu_seconds()
    yield
    with open(os.environ.get("CPU_LOG", "bench/results/test_cpu.txt"), "a") as f:
        f.write(f"{cpu_seconds() - start:8.2f} {item.nodeid}\n")
