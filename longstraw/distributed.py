"""Context parallelism over `torch.distributed` (gloo on CPU, NCCL on GPU).

Every rank runs the same group (`Engine.step` is called with the same `Group` on all
ranks). The per-token prompt state (attention K/V, MLA latents) is sharded by blocks
of positions dealt round-robin (`state.Shard`); small state (GDN recurrent state) is
replicated. The token computation itself (projections, MLP/MoE, norms, the branch's
own causal attention) is replicated on every rank, so only attention over the prompt
state is distributed:

    forward    each rank attends over its own shard -> partial (o_r, lse_r);
               all-gather and merge by log-sum-exp -> the same (o, lse) everywhere
    backward   each rank turns the (replicated) upstream gradient into its partial's
               gradient (no communication), runs its shard's blockwise backward, and
               the query gradient is summed over ranks (all-reduce)

Because everything outside that attention is replicated with replicated gradients,
every rank's `.grad` equals the single-process `.grad` with no parameter-gradient
reduction, LoRA and K/V projections included. Exact mode's state gradients live with
the shard that owns the rows; a chunk's seeds are summed over ranks (all-reduce)
before the reverse walk pushes them through the replicated recomputation.

What this buys is memory: each rank holds ~1/W of the prompt state and of the
attention work over it. The replicated token computation is not divided (sequence-
parallel token compute is future work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import LongStrawError


class DistributedError(LongStrawError, RuntimeError):
    """A collective failed (e.g. a peer rank died or the ranks disagree)."""


@dataclass(frozen=True)
class ContextParallel:
    """The process group a context-parallel engine runs over."""

    group: object
    rank: int
    world: int

    @classmethod
    def from_default_group(cls, group=None) -> "ContextParallel":
        if not dist.is_available() or not dist.is_initialized():
            raise LongStrawError(
                "ExecConfig(context_parallel=True) needs an initialized torch.distributed process group: launch with "
                "torchrun and call torch.distributed.init_process_group('gloo' or 'nccl') first"
            )
        group = group if group is not None else dist.group.WORLD
        return cls(group=group, rank=dist.get_rank(group), world=dist.get_world_size(group))


def _collective(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo/NCCL report a dead or hung peer as RuntimeError
        raise DistributedError(f"context-parallel collective {fn.__name__} failed (a peer rank may have died): "
                               f"{exc}") from exc


def all_reduce_sum(tensor: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Sum over ranks, in place; returns the tensor."""
    _collective(dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=cp.group)
    return tensor


def all_gather(tensor: torch.Tensor, cp: ContextParallel) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(cp.world)]
    _collective(dist.all_gather, out, tensor.contiguous(), group=cp.group)
    return out


class SumGradAcrossRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks. Put in front of a
    replicated tensor that feeds a rank-local (sharded) computation."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad.contiguous().clone(), ctx.cp), None


class MergeAcrossRanks(torch.autograd.Function):
    """(o_r [.., M, Dv], lse_r [.., M]) partial attentions of every rank -> their
    log-sum-exp merge (o, lse), identical on every rank.

    Backward needs no communication: with w_r = exp(lse_r - lse),
        d o_r   = w_r do
        d lse_r = w_r (do . o_r - do . o + dlse)
    and do, dlse are the same on every rank (the computation after the merge is
    replicated)."""

    @staticmethod
    def forward(ctx, out, lse, cp):
        outs, lses = all_gather(out, cp), all_gather(lse, cp)
        lse_all = torch.logsumexp(torch.stack(lses), dim=0)
        safe = torch.where(torch.isinf(lse_all), torch.zeros_like(lse_all), lse_all)
        merged = sum(torch.exp(l - safe)[..., None] * o for o, l in zip(outs, lses))
        ctx.save_for_backward(out, lse, merged, safe)
        return merged, lse_all

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        out, lse, merged, safe = ctx.saved_tensors
        w = torch.exp(lse - safe)  # (.., M); 0 where this rank saw nothing
        grad_out = torch.zeros_like(merged) if grad_out is None else grad_out
        dot = (grad_out * (out - merged)).sum(-1)
        if grad_lse is not None:
            dot = dot + grad_lse
        return w[..., None] * grad_out, w * dot, None


def check_same_group(fingerprint: torch.Tensor, cp: ContextParallel) -> None:
    """Raise on every rank if the ranks were not given the same group."""
    gathered = all_gather(fingerprint, cp)
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        from .errors import InvalidGroupError

        raise InvalidGroupError("context-parallel ranks were given different groups; every rank must call "
                                "Engine.step with the same Group")


def broadcast_from_first(tensor: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Overwrite `tensor` on every rank with rank 0's (of the group), in place."""
    _collective(dist.broadcast, tensor, src=dist.get_global_rank(cp.group, 0), group=cp.group)
    return tensor
