"""One rank of W in one process: the fake process group a rehearsal runs under.

`torch.distributed`'s fake backend (`init_process_group("fake", store=FakeStore(),
rank=r, world_size=W)`) lets one process play rank r of W: every collective returns at
once without moving data (an all-gather hands back W copies of this rank's tensor; an
all-reduce or a broadcast leaves the tensor as it is). The engine runs on it as on gloo
or NCCL: context parallelism (`ExecConfig(context_parallel=True)`: this rank's shard of
the prompt state, the divided capture and walk), expert parallelism (this rank's slice of
the experts) and FSDP2 (`parallel.sharding.shard_model` on the fake model: this rank's
shards, the layers gathered as a real run gathers them). The shapes, and so the live
bytes and the bytes of every collective, are this rank's; the values are not (no rank's
data reaches another), which a rehearsal never reads.

Which ranks: the ranks' shards differ in two ways. Rank 0 holds the most prompt rows
(the deal's fullest, `parallel.deal.Deal.fullest`); under expert parallelism with W not
dividing E, the first rank holding the most experts holds one expert per MoE layer more
than rank 0. `rehearsed_ranks` names these; `ls.rehearse(..., rank=...)` takes others.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from longstraw.config import ExecConfig
from longstraw.errors import ConfigError
from longstraw.models.experts import experts_modules
from longstraw.parallel.experts import expert_bounds
from longstraw.parallel.fsdp_traffic import counting_fsdp
from longstraw.parallel.sharding import shard_model

EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")
"""HF config fields that hold an MoE layer's number of routed experts."""


def check_world(config: ExecConfig, world_size: int, rank, shard_params: bool) -> None:
    """`ConfigError` for a `world_size` / `rank` / `shard_params` a rehearsal cannot run,
    before any work; also when this process already has a process group (the fake
    group would replace it)."""
    if world_size < 1:
        raise ConfigError(f"rehearse: world_size must be >= 1, got {world_size}")
    if world_size > 1 and not config.context_parallel:
        raise ConfigError(f"rehearse: world_size={world_size} rehearses one rank of a context-parallel run; pass "
                          "ExecConfig(context_parallel=True) (data-parallel replicas each rehearse as world_size=1)")
    if shard_params and world_size == 1:
        raise ConfigError("rehearse: shard_params=True shards over the ranks; pass world_size > 1")
    ranks = [] if rank is None else [rank] if isinstance(rank, int) else list(rank)
    if any(not isinstance(r, int) or not 0 <= r < world_size for r in ranks) or (rank is not None and not ranks):
        raise ConfigError(f"rehearse: rank must be an int (or ints) in [0, {world_size}), got {rank!r}")
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        raise ConfigError("rehearse: world_size > 1 plays one rank on a fake process group, but this process "
                          f"already has a process group ({dist.get_backend()}, rank {dist.get_rank()} of "
                          f"{dist.get_world_size()}); rehearse in a process without one (before init_process_group "
                          "or after destroy_process_group)")


def rehearsed_ranks(hf_config, config: ExecConfig, world_size: int, rank) -> list[int]:
    """The ranks to rehearse: `rank` where given (an int or ints), else rank 0 (the most
    prompt rows) and, under expert parallelism, the first rank with the most experts
    where that is not rank 0."""
    if rank is not None:
        return [rank] if isinstance(rank, int) else sorted(set(rank))
    ranks = [0]
    text = hf_config.get_text_config()
    experts = next((getattr(text, f) for f in EXPERT_FIELDS if isinstance(getattr(text, f, None), int)), None)
    if config.expert_parallel and experts and world_size > 1:
        held = [hi - lo for lo, hi in (expert_bounds(experts, world_size, r) for r in range(world_size))]
        if held.index(max(held)) != 0:
            ranks.append(held.index(max(held)))
    return ranks


@contextlib.contextmanager
def fake_group(rank: int, world_size: int):
    """This process as rank `rank` of `world_size` on the fake backend, for the block
    (nothing for world_size 1); the group is destroyed after."""
    if world_size == 1:
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shard_fake(model, world_size: int, device_type: str, *, expert_parallel: bool = False):
    """FSDP2 over the fake group's W ranks on the fake `model` (`shard_model`), as a real
    run's template shards it: under expert parallelism its experts are left out (each rank
    holds its own slice whole), otherwise FSDP2 shards them with the rest of each layer, as
    `shard_model(model, mesh)` does. Returns a context that counts FSDP2's collectives
    (`fsdp_traffic.counting_fsdp`). Call inside the fake mode, after the engine is built
    (expert parallelism cuts the experts first)."""
    with unset_fake_temporarily():  # the mesh reads its rank map on the host
        mesh = init_device_mesh(device_type, (world_size,))
    shard_model(model, mesh, ignored_params=expert_slices(model) if expert_parallel else None)
    return counting_fsdp()


def expert_slices(model) -> set:
    """The routed experts' own parameters (expert parallelism's slices once the engine cut
    them), which no FSDP2 unit may manage."""
    return {p for _, m in experts_modules(model) for p in m.parameters(recurse=False)}


__all__ = ["check_world", "expert_slices", "fake_group", "rehearsed_ranks", "shard_fake"]
