"""Context parallelism on torch.distributed (gloo, CPU, float64), in spawned processes.

With W = 2 and 3 ranks, for a dense, a hybrid (GDN) and MLA models (DeepSeek-V3; GLM-5
with dense and with sparse DSA selection; DeepSeek-V3.2 sparse), in detached and exact
mode, every rank's loss and every parameter gradient equal the single-process result (to
1e-9; exact mode's MoE models with HF's float32 routers to 1e-6, their dense-MLP twins to
1e-9: see `distributed_worker.FLOAT32_ROUTERS`), and each rank holds ~1/W of the per-token state; the planner's per-rank state and
exact-mode snapshot bytes equal the engine's ("planner"). A rank that fails makes the
others fail fast with a LongStrawError instead of hanging.
"""

import os
import time

import pytest
import torch.multiprocessing as mp

from tests import distributed_worker as worker


@pytest.mark.parametrize("world,cases", [(2, ["planner", "dense", "hybrid", "mla", "glm", "glm_sparse", "mla_mlp"]),
                                         (3, ["planner", "dense", "hybrid", "dsv32_sparse", "dsv32_sparse_mlp"])])
def test_context_parallel_equals_single_process(tmp_path, world, cases):
    mp.spawn(worker.run_cases, args=(world, str(tmp_path / "init"), cases, ["detached", "exact"]), nprocs=world,
             join=True)


def test_a_failing_rank_fails_the_job_quickly(tmp_path):
    start = time.monotonic()
    with pytest.raises(Exception):
        mp.spawn(worker.crash_one_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert time.monotonic() - start < 50  # well inside the 60 s process-group timeout
    # mp.spawn reports the first failure (rank 1); rank 0 must also have ended with our error
    deadline = time.monotonic() + 30
    while not os.path.exists(tmp_path / "rank0.failed") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "collective" in (tmp_path / "rank0.failed").read_text()


def test_fsdp2_sharded_layers_get_matching_gradient_slices(tmp_path):
    mp.spawn(worker.run_fsdp, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_generate_under_context_parallelism_equals_single_process(tmp_path):
    mp.spawn(worker.run_generate, args=(3, str(tmp_path / "init"), ["dense", "hybrid", "glm_sparse", "dsv32_sparse"]),
             nprocs=3, join=True)
def test_validation_that_fails_on_one_rank_fails_every_rank_fast(tmp_path):
    start = time.monotonic()
    mp.spawn(worker.bad_group_on_one_rank, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    assert time.monotonic() - start < 40  # the process-group timeout is 60 s
    rank0, rank1 = (tmp_path / "rank0.err").read_text(), (tmp_path / "rank1.err").read_text()
    assert "InvalidGroupError" in rank1 and "500" in rank1  # its own error, naming the bad token
    assert "InvalidGroupError" in rank0 and "rank(s) [1]" in rank0
    assert float(rank0.split()[0]) < 10


def test_one_rank_context_parallel_runs_on_the_backends_device(tmp_path):
    mp.spawn(worker.world_one, args=(1, str(tmp_path / "init"), str(tmp_path)), nprocs=1, join=True)
    assert (tmp_path / "ok").exists()


def test_collectives_pick_the_backends_device():
    import torch

    from longstraw.distributed import backend_device

    assert backend_device("gloo") == torch.device("cpu")
    assert backend_device("cpu:gloo,cuda:nccl") is None  # takes tensors where they are
    if torch.cuda.is_available():
        assert backend_device("nccl").type == "cuda"


def test_a_collective_error_is_not_reported_as_a_dead_peer(monkeypatch):
    """NCCL rejecting a CPU tensor used to read "a peer rank may have died"."""
    import torch
    import torch.distributed as dist

    import longstraw as ls
    from longstraw.distributed import ContextParallel, all_gather

    def fails(*args, **kwargs):
        raise RuntimeError("No backend type associated with device type cpu")

    monkeypatch.setattr(dist, "all_gather", fails)
    cp = ContextParallel(group=None, rank=0, world=2, backend="nccl", device=None)
    with pytest.raises(ls.LongStrawError) as info:
        all_gather(torch.zeros(3), cp)
    message = str(info.value)
    assert "nccl" in message and "device type cpu" in message and "peer rank may have died" not in message



@pytest.mark.parametrize("world", [2, 3])
def test_divided_capture_at_awkward_block_and_chunk_boundaries(tmp_path, world):
    mp.spawn(worker.run_divided, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_divided_reverse_walk_equals_single_process(tmp_path, world):
    mp.spawn(worker.run_divided_walk, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 3])
def test_attention_over_a_shard_equals_the_whole_prefix(tmp_path, world):
    mp.spawn(worker.run_shard_attention, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


def test_a_walk_that_raises_on_one_rank_restores_every_ranks_grad(tmp_path):
    mp.spawn(worker.walk_raises_on_one_rank, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_replicated_gradients_agree_and_diverged_weights_are_caught(tmp_path):
    mp.spawn(worker.replicas_agree, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
