"""Context parallelism over `torch.distributed` (gloo on CPU, NCCL on GPU).

Every rank runs the same group (`Engine.step` is called with the same `Group` on all
ranks). The per-token prompt state (attention K/V, MLA latents) is sharded by blocks
of positions dealt round-robin (`state.Shard`); small state (GDN recurrent state) is
replicated. Capture's token computation is divided for dense, GDN-hybrid and MLA/DSA
families (each prompt token on the rank that owns its block, layer by layer:
`sequence_parallel.py`), and so is exact mode's reverse walk (each prompt token
recomputed and backpropagated on its owner). Replay runs its token computation
(projections, MLP/MoE, norms, the branch's own causal attention) on every rank, and only
attention over the prompt state is distributed:

    forward    each rank attends over its own shard -> partial (o_r, lse_r);
               all-gather and merge by log-sum-exp -> the same (o, lse) everywhere
    backward   each rank turns the (replicated) upstream gradient into its partial's
               gradient (no communication), runs its shard's blockwise backward, and
               the query gradient is summed over ranks (all-reduce)

Because everything outside that attention is replicated with replicated gradients,
every rank's `.grad` equals the single-process `.grad` with no parameter-gradient
reduction, LoRA and K/V projections included; a divided reverse walk's gradients are
partial, and one bucketed all-reduce per step sums them (`partial_gradients`). Exact
mode's state gradients live with the shard that owns the rows; in a replicated walk a
chunk's seeds are summed over ranks (all-reduce) before the recomputation pushes them
through; in a divided walk each rank seeds its own rows.

Collectives run on the device the group's backend carries (`ContextParallel.device`:
the current CUDA device for NCCL, so call `torch.cuda.set_device(local_rank)` before
building the engine; CPU for gloo); `ops/collectives.py` moves tensors there and back.

What this buys: each rank holds ~1/W of the prompt state and does ~1/W of the
attention work over it and of capture's and the reverse walk's token computation;
replay's token computation is not divided
(docs/distributed.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import DistributedError, InvalidGroupError, LongStrawError
from .ops.collectives import MergeAcrossRanks, SumGradAcrossRanks, all_gather, all_reduce_sum, broadcast_from_first


def backend_device(backend: str) -> torch.device | None:
    """The device a backend's collectives need: NCCL carries CUDA tensors only (the
    current CUDA device), gloo (and the other CPU backends) CPU tensors; None for a
    mixed backend ("cpu:gloo,cuda:nccl") that takes tensors where they are."""
    backend = str(backend).lower()
    if "," in backend or ":" in backend:
        return None
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class ContextParallel:
    """The process group a context-parallel engine runs over.

    Fields:
        group: the torch.distributed process group.
        rank, world: this rank and the number of ranks in `group`.
        backend: the group's backend name ("gloo", "nccl", ...).
        device: where its collectives need their tensors (`backend_device`).
    """

    group: object
    rank: int
    world: int
    backend: str = "gloo"
    device: torch.device | None = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def from_default_group(cls, group=None) -> "ContextParallel":
        if not dist.is_available() or not dist.is_initialized():
            raise LongStrawError(
                "ExecConfig(context_parallel=True) needs an initialized torch.distributed process group: launch with "
                "torchrun and call torch.distributed.init_process_group('gloo' or 'nccl') first"
            )
        group = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group))
        return cls(group=group, rank=dist.get_rank(group), world=dist.get_world_size(group), backend=backend,
                   device=backend_device(backend))


def check_same_group(fingerprint: torch.Tensor, cp: ContextParallel, *, problem: str = "") -> None:
    """Raise on every rank, together, if the ranks were not given the same group or any
    rank found a problem in its own validation (`problem`: that rank's error message,
    "" for none). One all-gather carries both, so no rank waits for a peer that
    already raised."""
    flag = torch.tensor([1.0 if problem else 0.0], dtype=torch.float64)
    gathered = all_gather(torch.cat([flag, fingerprint.to(torch.float64).flatten()]), cp)
    failed = [r for r, g in enumerate(gathered) if g[0] != 0]
    if failed:
        raise InvalidGroupError(f"context-parallel validation failed on rank(s) {failed}"
                                + (f": {problem}" if problem else "; see that rank's error"))
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        raise InvalidGroupError("context-parallel ranks were given different groups; every rank must call "
                                "Engine.step with the same Group")


__all__ = ["ContextParallel", "DistributedError", "MergeAcrossRanks", "SumGradAcrossRanks", "all_gather",
           "all_reduce_sum", "backend_device", "broadcast_from_first",
           "check_same_group"]
