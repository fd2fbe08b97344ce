"""The planner's replay communication against the engine's measured bytes (gloo, W = 2 and
3, spawned workers: `tests/comm_worker.py`). Capture's and the divided walk's bytes are
checked the same way in tests/distributed_worker.py (`check_planner`)."""

import pytest
from tests.ranks import WORLDS, spawn


@pytest.mark.slow  # 12 context-parallel steps per world: about a minute here (opt in with -m slow)
@pytest.mark.parametrize("world", [2, 3])
def test_planned_replay_bytes_equal_the_measured_ones(tmp_path, world):
    from tests import comm_worker
    spawn(comm_worker.run, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


@pytest.mark.parametrize("world", WORLDS)
def test_planned_expert_gradient_and_data_parallel_bytes_equal_the_measured_ones(tmp_path, world):
    """The MoE combines under expert parallelism (capture, replay, the divided walk), the
    replicated gradients' broadcast after a detached step, sparse DSA's candidates in
    replay, and the data-parallel gradient all-reduce (`comm_worker.run_parallelisms`)."""
    from tests import comm_worker
    spawn(comm_worker.run_parallelisms, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
