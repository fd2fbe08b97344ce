"""Context parallelism on torch.distributed (gloo, CPU, float64), in spawned processes.

With W = 2 and 3 ranks, for a dense, a hybrid (GDN) and MLA models (DeepSeek-V3; GLM-5
with dense and with sparse DSA selection; DeepSeek-V3.2 sparse), in detached and exact mode, every rank's loss and every parameter gradient equal the single-process
result, and each rank holds ~1/W of the per-token state. A rank that fails makes the
others fail fast with a LongStrawError instead of hanging.
"""

import os
import time

import pytest
import torch.multiprocessing as mp

from tests import distributed_worker as worker


@pytest.mark.parametrize("world,cases", [(2, ["dense", "hybrid", "mla", "glm", "glm_sparse"]),
                                         (3, ["dense", "hybrid", "dsv32_sparse"])])
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
