"""Worker processes for tests/models/test_recompute.py's context-parallel case (spawned,
gloo, CPU, float64): under context parallelism, where the recompute re-runs each
layer's collectives inside backward, replay with layer-wise recompute gives every rank
the loss and `.grad` of replay without it, for each family kind, detached and exact
(divided capture and walk), in pieces and with an offloaded state."""

from __future__ import annotations

import torch.distributed as dist

from tests.distributed_worker import _init
from tests.models.test_recompute import EXEC, GROUP, MODELS, assert_recompute_changes_nothing
import longstraw as ls
from tests.reference import assert_grads_close, assert_loss_close, grads_of, random_group


def run(rank: int, world: int, init_file: str) -> None:
    _init(rank, world, init_file)
    try:
        group = random_group(GROUP["vocab"], GROUP["prompt_len"], GROUP["response_lens"], seed=3)
        for name, make in MODELS.items():
            model = make()
            # the offloaded shard in exact mode only, where the walk reads it back too
            for mode, extra in (("detached", {}), ("exact", {}), ("exact", {"state_device": "cpu"})):
                kw = dict(EXEC, mode=mode, branch_chunk_size=3, shard_block_size=3, context_parallel=True, **extra)
                metrics = assert_recompute_changes_nothing(model, group, kw)
                assert metrics["comm_bytes_replay"] > 0, (name, mode)
    finally:
        dist.destroy_process_group()


def run_walk(rank: int, world: int, init_file: str) -> None:
    """Exact mode's reverse walk with layer-wise recompute, divided over the ranks (each
    prompt token recomputed on one rank, each layer's collectives re-run in backward):
    loss and `.grad` equal the walk without recompute, for each family kind; and with
    the GDN snapshots in host memory (`offload_snapshots`) they equal them on the device."""
    _init(rank, world, init_file)
    try:
        group = random_group(GROUP["vocab"], GROUP["prompt_len"], GROUP["response_lens"], seed=9)
        for name, make in MODELS.items():
            kw = dict(EXEC, mode="exact", shard_block_size=3, context_parallel=True)
            metrics = assert_recompute_changes_nothing(make(), group, kw)
            assert metrics["divided_walk"] == 1.0 and metrics["walk_recompute_layers"] == 1.0, name
            assert metrics["comm_bytes_reverse"] > 0, name
        # the snapshots in host memory under the divided walk: the on-device step's loss and .grad
        model = MODELS["qwen3_5"]()
        model.zero_grad(set_to_none=True)
        kw = dict(EXEC, mode="exact", shard_block_size=3, context_parallel=True)
        want = ls.Engine(model, ls.ExecConfig(offload_snapshots=False, **kw)).step(group)
        want_grads = grads_of(model)
        model.zero_grad(set_to_none=True)
        got = ls.Engine(model, ls.ExecConfig(offload_snapshots=True, **kw)).step(group)
        assert_loss_close(got.loss, want.loss, 1e-15)
        assert_grads_close(grads_of(model), want_grads, 1e-15)
        assert got.metrics["divided_walk"] == 1.0 and got.metrics["snapshot_h2d_bytes"] > 0
    finally:
        dist.destroy_process_group()
