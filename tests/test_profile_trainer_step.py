"""bench/profile_trainer_step.py: its idle-machine prediction from each rank's CPU seconds
between sync events (no processes are launched here)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.profile_trainer_step import simulate  # noqa: E402


def trace(*events):
    """(kind, phase, cpu at entry, cpu at exit, peer) rows, after a `begin` at cpu 0."""
    return [("begin", "other", 0.0, 0.0, None), *events]


def test_a_collective_waits_for_the_last_rank_and_costs_the_least_cpu_spent_in_it():
    # rank 0 computes 1 s, rank 1 3 s, then one all-reduce (rank 0 spins 0.5 s in it, rank 1 0.1 s), then 1 s each
    fast = trace(("all_reduce", "capture", 1.0, 1.5, None), ("end", "other", 2.5, 2.5, None))
    slow = trace(("all_reduce", "capture", 3.0, 3.1, None), ("end", "other", 4.1, 4.1, None))
    wall, waits = simulate([fast, slow])
    assert wall == pytest.approx(3.0 + 0.1 + 1.0)
    assert waits == {"capture": pytest.approx(2.0)}


def test_a_recv_waits_for_its_send_only():
    sender = trace(("isend", "capture", 1.0, 1.0, 1), ("end", "other", 1.2, 1.2, None))
    receiver = trace(("recv", "capture", 0.25, 0.25, 0), ("end", "other", 0.5, 0.5, None))
    wall, waits = simulate([sender, receiver])
    assert waits == {"capture": pytest.approx(0.75)}  # the receiver reached its recv at 0.25, the send left at 1
    assert wall == pytest.approx(1.25)  # 1 + the receiver's 0.25 s after it (the sender ends at 1.2)


def test_ranks_whose_collectives_differ_are_refused():
    one = trace(("all_reduce", "capture", 1.0, 1.0, None), ("end", "other", 2.0, 2.0, None))
    other = trace(("broadcast", "capture", 1.0, 1.0, None), ("end", "other", 2.0, 2.0, None))
    with pytest.raises(SystemExit, match="differ"):
        simulate([one, other])


def test_cpu_between_counted_steps_is_not_counted():
    # two counted steps of 1 s each, 5 s of logging and optimizer work between them
    steps = [("begin", "other", 0.0, 0.0, None), ("end", "other", 1.0, 1.0, None),
             ("begin", "other", 6.0, 6.0, None), ("end", "other", 7.0, 7.0, None)]
    wall, waits = simulate([steps])
    assert wall == pytest.approx(2.0) and not waits
