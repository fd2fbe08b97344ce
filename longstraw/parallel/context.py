"""The process group a context-parallel engine runs over (`ContextParallel`, and the
device its backend carries tensors on: `backend_device`), validation that fails on every
rank together (`check_same_group`), and the replica check of the ranks' weights
(`fingerprint`, `check_replicas`). The design: `longstraw.parallel`; docs/distributed.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from longstraw.errors import DistributedError, InvalidGroupError, LongStrawError
from longstraw.parallel.experts import is_expert_shard
from longstraw.parallel.collectives import MergeAcrossRanks, SumGradAcrossRanks, all_gather, all_reduce_sum, broadcast_from_first


def backend_device(backend: str) -> torch.device | None:
    """The device a backend's collectives need: NCCL carries CUDA tensors only (the
    current CUDA device), gloo (and the other CPU backends) CPU tensors; None for a
    mixed backend ("cpu:gloo,cuda:nccl") or the fake one that take tensors where they are."""
    backend = str(backend).lower()
    if "," in backend or ":" in backend or backend == "fake":  # fake: a rehearsal's group (`rehearsal/ranks.py`)
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


# ----------------------------------------------------------------------------
# replicas: the ranks' weights, compared


_BITS = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.int8}  # 8-byte elements: two int32 words


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's fingerprint, int64 [2], on its device: the exact integer sum of its bit
    patterns (as int32/int16/int8 words, accumulated in int64: no overflow below 2^32
    elements, and any change of one element changes it) and the bits of its float64 sum
    of values. Equal tensors give equal fingerprints; no host sync."""
    flat = tensor.detach().reshape(-1)
    words = flat.view(_BITS[flat.element_size()])  # (n,) or (2n,)
    values = flat.sum(dtype=torch.float64) if flat.is_floating_point() else flat.sum(dtype=torch.int64).double()
    return torch.stack([words.sum(dtype=torch.int64), values.view(torch.int64)])


def check_replicas(model, group=None, *, trainable_only: bool = True) -> int:
    """Check that every rank of `group` holds bitwise the same weights; raise on every rank
    together if not.

    Each rank fingerprints its parameters (`fingerprint`: two int64 per parameter,
    computed on the parameters' device), one all-gather brings every rank's fingerprints to
    every rank, and they are compared exactly. Cost: one read of the weights and
    16 bytes per parameter per rank of traffic; run it every N optimizer steps
    (`TrainConfig.replica_check_every`, the trainer's `longstraw_replica_check_every`).

    Args:
        model: the module whose parameters are compared (FSDP2's DTensor shards and
            expert-parallel slices are skipped: they differ by design).
        group: a torch.distributed process group, or an engine's `ContextParallel`
            (`engine.cp`); None: the default group, or nothing to compare when
            torch.distributed is not initialized (one process holds one replica).
        trainable_only: compare only parameters with `requires_grad` (the ones an optimizer
            moves); False compares every parameter.

    Returns:
        The number of parameters compared (0 in one process).

    Raises:
        DistributedError: the ranks hold different parameter counts, or some parameter
            differs; the message names the first such parameter, the ranks that differ from
            the first rank and how many parameters differ.
    """
    if isinstance(group, ContextParallel):
        cp = group
    elif group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    else:
        cp = ContextParallel.from_default_group(group)
    if cp.world == 1:
        return 0
    named = [(n, p) for n, p in model.named_parameters()  # FSDP2 shards and expert slices differ by design
             if not isinstance(p, DTensor) and not is_expert_shard(p) and (p.requires_grad or not trainable_only)]
    counts = all_gather(torch.tensor([float(len(named))], dtype=torch.float64), cp)
    if not all(torch.equal(c, counts[0]) for c in counts):
        raise DistributedError(f"check_replicas: the ranks hold different numbers of parameters "
                               f"({[int(c) for c in counts]}); every rank must check the same model")
    if not named:
        return 0
    mine = torch.stack([fingerprint(p) for _, p in named])  # (n, 2)
    every = torch.stack(all_gather(mine, cp)).cpu()  # (W, n, 2): the one host read
    differs = (every != every[0]).any(-1)  # (W, n)
    if differs.any():
        bad = differs.any(0).nonzero()[:, 0]
        first = int(bad[0])
        ranks = differs[:, first].nonzero()[:, 0].tolist()
        raise DistributedError(
            f"replicas diverged: parameter {named[first][0]!r} differs on rank(s) {ranks} from rank 0 "
            f"({bad.numel()} of {len(named)} parameters differ). The ranks' weights must stay bitwise equal: make "
            "every rank apply the same update from the same gradients (the engine's replicated gradients are the "
            "first rank's), and resume every rank from the same checkpoint")
    return len(named)


__all__ = ["ContextParallel", "DistributedError", "MergeAcrossRanks", "SumGradAcrossRanks", "all_gather",
           "all_reduce_sum", "backend_device", "broadcast_from_first",
           "check_replicas", "check_same_group", "fingerprint"]
