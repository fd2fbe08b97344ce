"""Context parallelism on torch.distributed (gloo, CPU, float64), in spawned processes.

With W = 2 and 3 ranks, for a dense, a hybrid (GDN) and MLA models (DeepSeek-V3; GLM-5
with dense and with sparse DSA selection; DeepSeek-V3.2 sparse), in detached and exact
mode, every rank's loss and every parameter gradient equal the single-process result (to
FLOAT64; the MoE models with HF's float32 routers to FLOAT32_INTERNALS, their dense-MLP
twins to FLOAT64: see `distributed_worker.FLOAT32_ROUTERS`), and each rank holds ~1/W of the per-token state; the planner's per-rank state and
exact-mode snapshot bytes equal the engine's ("planner"). A rank that fails makes the
others fail fast with a LongStrawError instead of hanging.
"""

import pytest

from tests import distributed_worker as worker
from tests import vision_worker
from tests.ranks import WORLDS, spawn


@pytest.mark.parametrize("world,cases", [(2, ["mla", "glm", "glm_sparse", "glm_sparse/select2", "mla_mlp"]),
                                         (3, ["planner", "dense", "hybrid", "dsv32_sparse", "dsv32_sparse_mlp"]),
                                         pytest.param(2, ["planner", "dense", "hybrid"], marks=pytest.mark.slow)])
def test_context_parallel_equals_single_process(tmp_path, world, cases):
    """The planner, dense and hybrid cases at W = 2 repeat W = 3's (`[3-cases1]`, default
    suite: a middle rank and uneven shards besides what W = 2 has): -m slow (`[2-cases2]`).
    Then, in the same processes, a Qwen3.5 VLM prompt with two images whose rows lie on
    both ranks' blocks (`vision_worker.run_images`): at W = 2 detached, exact with a divided and
    a replicated walk, loss and every .grad, the vision tower's included, and a greedy agent
    episode equal one process's; at W = 3 (one rank runs no image in the tower) the divided exact step."""
    spawn(vision_worker.run_cases_then_images, args=(world, str(tmp_path / "init"), cases, ["detached", "exact"]),
          nprocs=world, join=True)


def _run_each(fn, nprocs: int, *args) -> list[int]:
    """Spawn `nprocs` ranks of fn and join each one by itself; return their exit codes.
    (mp.spawn's own join terminates the other ranks as soon as one fails, which races the
    report a surviving rank is about to write.) A generous wait: these tests check what the
    ranks did, never how fast, and a loaded machine may take minutes to import torch."""
    return worker.spawn_each(fn, nprocs, (nprocs, *args), worker.PG_TIMEOUT_S + 120)


def _not_a_timeout(text: str) -> bool:
    return "timed out" not in text.lower() and "timeout" not in text.lower()


def test_prefix_trees_under_context_parallelism_equal_single_process(tmp_path):
    """W = 2: dense, GDN hybrid and sparse GLM trees, both modes (`distributed_worker.run_trees`)."""
    spawn(worker.run_trees, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_a_failing_rank_fails_the_job_quickly(tmp_path):
    """Rank 1 raises before its step: rank 0 ends with our DistributedError, raised because
    its collective saw the dead peer, not by waiting out the process-group timeout."""
    codes = _run_each(worker.crash_one_rank, 2, str(tmp_path / "init"), str(tmp_path))
    assert codes[0] != 0 and codes[1] != 0, codes
    report = (tmp_path / "rank0.failed").read_text()
    assert "collective" in report and _not_a_timeout(report), report


def test_fsdp2_sharded_layers_get_matching_gradient_slices(tmp_path):
    spawn(worker.run_fsdp, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_fsdp2_on_a_2d_mesh_with_held_replica_reductions_divides_the_walk(tmp_path):
    """A (1, 2) HSDP mesh, FSDP2's all-reduce across replicas held for one sum per step."""
    spawn(worker.run_fsdp_2d, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_generate_under_context_parallelism_equals_single_process(tmp_path):
    spawn(worker.run_generate, args=(3, str(tmp_path / "init"), ["dense", "hybrid", "glm_sparse", "dsv32_sparse"]),
          nprocs=3, join=True)
def test_agent_episodes_under_context_parallelism_equal_single_process(tmp_path):
    spawn(worker.run_episode, args=(2, str(tmp_path / "init"), ["dense", "hybrid", "glm_sparse"]), nprocs=2,
          join=True)


def test_validation_that_fails_on_one_rank_fails_every_rank_fast(tmp_path):
    """Every rank raises a LongStrawError from the one agreement all-gather: rank 1 its own
    error, rank 0 one naming rank 1 (so it learned it from the collective, not a timeout)."""
    codes = _run_each(worker.bad_group_on_one_rank, 2, str(tmp_path / "init"), str(tmp_path))
    assert codes == [0, 0], codes
    rank0, rank1 = (tmp_path / "rank0.err").read_text(), (tmp_path / "rank1.err").read_text()
    assert "InvalidGroupError" in rank1 and "500" in rank1  # its own error, naming the bad token
    assert "InvalidGroupError" in rank0 and "rank(s) [1]" in rank0 and _not_a_timeout(rank0)


def test_loss_masks_under_context_parallelism_match_hf(tmp_path):
    """W = 2: the masked step equals HF's masked loss on every rank, and ranks given
    different loss masks all refuse the group (the masks are in the agreement)."""
    codes = _run_each(worker.run_masked, 2, str(tmp_path / "init"), str(tmp_path))
    assert codes == [0, 0], codes
    for rank in (0, 1):
        assert "different groups" in (tmp_path / f"rank{rank}.err").read_text()


def test_one_rank_context_parallel_runs_on_the_backends_device(tmp_path):
    spawn(worker.world_one, args=(1, str(tmp_path / "init"), str(tmp_path)), nprocs=1, join=True)
    assert (tmp_path / "ok").exists()


def test_collectives_pick_the_backends_device():
    import torch

    from longstraw.parallel.context import backend_device

    assert backend_device("gloo") == torch.device("cpu")
    assert backend_device("cpu:gloo,cuda:nccl") is None  # takes tensors where they are
    if torch.cuda.is_available():
        assert backend_device("nccl").type == "cuda"


def test_a_collective_error_is_not_reported_as_a_dead_peer(monkeypatch):
    """NCCL rejecting a CPU tensor used to read "a peer rank may have died"."""
    import torch

    import longstraw as ls
    from longstraw.parallel import collectives
    from longstraw.parallel.context import ContextParallel, all_gather

    def fails(*args, **kwargs):
        raise RuntimeError("No backend type associated with device type cpu")

    monkeypatch.setattr(collectives, "_gather_into_tensor", fails)  # the all-gather's collective
    cp = ContextParallel(group=None, rank=0, world=2, backend="nccl", device=None)
    with pytest.raises(ls.LongStrawError) as info:
        all_gather(torch.zeros(3), cp)
    message = str(info.value)
    assert "nccl" in message and "device type cpu" in message and "peer rank may have died" not in message


@pytest.mark.parametrize("world", WORLDS)
def test_divided_capture_at_awkward_block_and_chunk_boundaries(tmp_path, world):
    spawn(worker.run_divided, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


@pytest.mark.parametrize("world,every_geometry", [(3, False), pytest.param(3, True, marks=pytest.mark.slow),
                                                   pytest.param(2, True, marks=pytest.mark.slow)])
def test_divided_reverse_walk_equals_single_process(tmp_path, world, every_geometry):
    """By default W = 3 without the geometries other cases repeat
    (`distributed_worker.WALK_GEOMETRY_REPEATS`); all of them at W = 2 and 3: -m slow."""
    spawn(worker.run_divided_walk, args=(world, str(tmp_path / "init"), every_geometry), nprocs=world, join=True)


@pytest.mark.parametrize("world", WORLDS)
def test_attention_over_a_shard_equals_the_whole_prefix(tmp_path, world):
    spawn(worker.run_shard_attention, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


def test_a_walk_that_raises_on_one_rank_restores_every_ranks_grad(tmp_path):
    spawn(worker.walk_raises_on_one_rank, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_replicated_gradients_agree_and_diverged_weights_are_caught(tmp_path):
    spawn(worker.replicas_agree, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


@pytest.mark.parametrize("world", [2, 3])  # W = 2: bitwise equal to the two all-reduces
def test_decode_merges_each_layer_in_one_collective(tmp_path, world):
    spawn(worker.decode_merge_in_one_collective, args=(world, str(tmp_path / "init")), nprocs=world, join=True)


@pytest.mark.slow
def test_kept_attention_outputs_under_context_parallelism_equal_single_process(tmp_path):
    """W = 3, exact, replicated capture and walk with `keep_attention_outputs`
    (`distributed_worker.run_kept_outputs`)."""
    spawn(worker.run_kept_outputs, args=(3, str(tmp_path / "init")), nprocs=3, join=True)
