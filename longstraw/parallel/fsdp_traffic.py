"""FSDP2's own collectives counted in `collectives.Traffic` (`counting_fsdp`).

FSDP2 (`parallel/sharding.shard_model`) gathers a layer's parameters and reduce-scatters
its gradients itself, through `torch.distributed.all_gather_single` (with this rank's
padded shard as input) and `reduce_scatter_single`, not through LongStraw's collectives,
so the engine's `comm_bytes_*` leave them out. While `counting_fsdp()` is open, both add
to `Traffic` by its model: (W-1) x the shard gathered ("fsdp_all_gather"), (W-1)/W of the
input reduce-scattered ("fsdp_reduce_scatter"); not when LongStraw's own collective
calls them (`collectives.reduce_scatter_sum` goes through `reduce_scatter_single`:
expert parallelism's combine was counted twice under FSDP2, `Traffic.inside`). A rehearsal with `shard_params=True`
opens it (`rehearsal/ranks.py`), and so do the tests that measure a real FSDP2 step
(`tests/comm_worker.py`), so both count the same bytes the same way.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from longstraw.parallel.collectives import Traffic


@contextlib.contextmanager
def counting_fsdp():
    """Within the block, FSDP2's all-gathers and reduce-scatters add to `Traffic`
    (bytes this rank receives, the ring model's); restored on exit."""
    saved = dist.all_gather_single, dist.reduce_scatter_single
    gather, scatter = saved

    def all_gather_single(output, input, *args, **kwargs):
        if not Traffic.inside:
            world = dist.get_world_size(kwargs.get("group"))
            Traffic.add((world - 1) * input.numel() * input.element_size(), "fsdp_all_gather")
        return gather(output, input, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):
        if not Traffic.inside:  # not LongStraw's own (`collectives.reduce_scatter_sum` calls it too)
            world = dist.get_world_size(kwargs.get("group"))
            Traffic.add((world - 1) / world * input.numel() * input.element_size(), "fsdp_reduce_scatter")
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = saved


__all__ = ["counting_fsdp"]
