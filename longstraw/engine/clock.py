"""How the engine times and shows its phases: a phase clock that is right on CUDA, and
one progress bar per phase (capture, generate, replay, reverse)."""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from longstraw.heartbeat import beat


def clock(device: torch.device) -> float:
    """A phase timestamp: on CUDA, after the queued kernels finish (else the time of
    launching them, not of running them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


_LOOPS: list[list] = []  # the named `progress` loops running now, outermost first: [desc, done, total, start]


def progress(iterable, *, enabled: bool, desc: str | None, total: int):
    """One progress bar per phase; desc None: none (a branch's pieces run inside the
    replay bar, so they get no bar of their own). Each item beats (`longstraw.heartbeat`):
    the loop moved on, progress for the launch watchdog. A named loop's position is
    readable while it runs, bar or not (`loop_position`)."""
    bar = iterable if not enabled or desc is None else tqdm(iterable, desc=desc, total=total, leave=False)
    state = None if desc is None else [desc, 0, total, time.perf_counter()]
    if state is not None:
        _LOOPS.append(state)
    try:
        for item in bar:
            beat()
            yield item
            if state is not None:
                state[1] += 1
    finally:
        if state is not None:  # by identity: two loops may hold equal values
            del _LOOPS[next(i for i, s in enumerate(_LOOPS) if s is state)]


def loop_position() -> tuple[str, int, int, float] | None:
    """(desc, items done, total, seconds since it began) of the innermost named `progress`
    loop running now, or None; safe to read from another thread (a rehearsal's progress
    lines give an estimate of the time left from it)."""
    loops = list(_LOOPS)
    if not loops:
        return None
    desc, done, total, start = loops[-1]
    return desc, done, total, time.perf_counter() - start


class ProgressCounter:
    """A progress bar advanced by hand (`advance(n)`), for a phase whose units finish
    out of a loop's order (a prefix tree's leaves); a no-op when disabled. Close it
    with `close()` or use it as a context manager."""

    def __init__(self, *, enabled: bool, desc: str, total: int):
        self.bar = tqdm(desc=desc, total=total, leave=False) if enabled else None

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
