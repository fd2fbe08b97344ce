"""Progress beats: the one signal the launch watchdog (`parallel/launch.py`) reads.

Below every layer (torch-free, imports nothing): the places that prove a step is moving
call `beat()`: every LongStraw collective as it completes (`parallel/collectives.py`),
every run of a model's decoder stack (`models/routing.run_backbone`: a capture or walk
chunk, a replay piece, one decode step of `generate`, whose FSDP2 all-gathers completed
to get there), and every item of the engine's loops (`engine/clock.progress`). A phase
may then run as long as it needs; the watchdog ends the process only when no beat came
for twice LONGSTRAW_COLLECTIVE_TIMEOUT (a collective that never returns, a stuck kernel).

A beat is one float stored (atomic under the GIL), read by the watchdog's thread.
"""

from __future__ import annotations

import time

_LAST = [time.monotonic()]  # monotonic time of the latest beat
_COUNT = [0]


def beat() -> None:
    """Record progress now (cheap: call it as often as you like)."""
    _LAST[0] = time.monotonic()
    _COUNT[0] += 1


def last_beat() -> float:
    """`time.monotonic()` of the latest beat (the import's time before any)."""
    return _LAST[0]


def beats() -> int:
    """How many beats this process recorded."""
    return _COUNT[0]


__all__ = ["beat", "beats", "last_beat"]
