"""Collectives of context parallelism, and the two autograd Functions built on them.

`cp` below is a `parallel.context.ContextParallel`: it names the process group (`cp.group`),
the number of ranks (`cp.world`) and the device the group's backend carries tensors on
(`cp.device`: CUDA for NCCL, CPU for gloo, None when the backend takes either). Every
collective here moves its tensors to that device and back, so a CPU tensor never
reaches NCCL and a CUDA tensor never reaches a CPU-only gloo group.

This module knows nothing of the engine or the models: it sits at the bottom of the
package, and `ops/attention.py`, the models and the rest of `parallel/` call it. The
design: `longstraw.parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longstraw.defaults import GRADIENT_BUCKET_BYTES
from longstraw.errors import DistributedError
from longstraw.heartbeat import beat
from longstraw.tensors import nbytes


def _collective(fn, cp, *args, **kwargs):
    Traffic.inside += 1  # counted here already: `fsdp_traffic.counting_fsdp` leaves it alone
    try:
        out = fn(*args, group=cp.group, **kwargs)
        beat()  # progress for the launch watchdog (`longstraw.heartbeat`)
        return out
    except (RuntimeError, ValueError) as exc:  # gloo/NCCL errors, a dead peer's timeout included
        backend = getattr(cp, "backend", "?")
        raise DistributedError(
            f"context-parallel collective {fn.__name__} failed on the {backend} backend ({exc}). Every rank must "
            "call it with the same group; if another rank failed first or died, its own error is the cause."
        ) from exc
    finally:
        Traffic.inside -= 1


class Traffic:
    """Bytes this rank received through the collectives below, by a simple model of each:
    broadcast and recv: the tensor (not at the source); all-gather: (W-1) tensors;
    all-reduce: 2 (W-1)/W of the tensor (ring); reduce-scatter: (W-1)/W of its
    input. `bench/bench_cp.py` reads it around a phase and compares it with the
    planner's prediction. `by_collective` splits the same bytes by collective
    ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "recv"; FSDP2's own under
    `fsdp_traffic.counting_fsdp`): what a rehearsal reports per phase (`rehearsal/measure.py`)."""

    received = 0
    by_collective: dict[str, int] = {}
    inside = 0
    """Depth of LongStraw's own collectives in progress (their bytes are counted by them)."""

    @classmethod
    def add(cls, nbytes: float, collective: str) -> None:
        cls.received += int(nbytes)
        cls.by_collective[collective] = cls.by_collective.get(collective, 0) + int(nbytes)


def _all_reduce(tensor: torch.Tensor, cp, op) -> torch.Tensor:
    """All-reduce in place with `op`, through a contiguous buffer on the backend's device
    when the tensor is not one already (a backend reduces the storage in order: ranks
    whose tensors have different strides would pair different elements); returns it."""
    Traffic.add(2 * (cp.world - 1) / cp.world * nbytes(tensor), "all_reduce")
    device = getattr(cp, "device", None)
    if tensor.is_contiguous() and (device is None or tensor.device == device):
        _collective(dist.all_reduce, cp, tensor, op=op)
        return tensor
    moved = (tensor if device is None else tensor.to(device)).contiguous()
    _collective(dist.all_reduce, cp, moved, op=op)
    return tensor.copy_(moved)


def all_reduce_sum(tensor: torch.Tensor, cp) -> torch.Tensor:
    """Sum over ranks, in place (through the backend's device when it differs); returns the tensor."""
    return _all_reduce(tensor, cp, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor, cp) -> torch.Tensor:
    """Elementwise max over ranks, in place (through the backend's device when it differs)."""
    return _all_reduce(tensor, cp, dist.ReduceOp.MAX)


def _gather_into_tensor(output, input, group=None):
    """All ranks' `input`s into one flat buffer `output` [W * n] (gloo takes it flat);
    `all_gather_single` is its name from torch 2.13, where `all_gather_into_tensor` is
    deprecated. Looked up per call, so a patched `torch.distributed` is honoured."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group)


def all_gather_stacked(tensor: torch.Tensor, cp) -> torch.Tensor:
    """Every rank's `tensor` (same shape on all ranks) stacked in rank order: [W, *tensor.shape],
    on `tensor`'s device."""
    device = getattr(cp, "device", None)
    moved = tensor.contiguous() if device is None else tensor.to(device).contiguous()
    Traffic.add((cp.world - 1) * nbytes(moved), "all_gather")
    flat = moved.new_empty(cp.world * moved.numel())  # one buffer, not W: one op each way on a rehearsal too
    _collective(_gather_into_tensor, cp, flat, moved.reshape(-1))
    return flat.view(cp.world, *moved.shape).to(tensor.device)


def all_gather(tensor: torch.Tensor, cp) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in rank order, on `tensor`'s device."""
    return list(all_gather_stacked(tensor, cp).unbind(0))


def reduce_scatter_sum(tensor: torch.Tensor, cp) -> torch.Tensor:
    """tensor [W * m, ..] (rank s's block: rows s*m .. (s+1)*m) -> [m, ..], this rank's
    block summed over ranks (through the backend's device when it differs). Each rank
    receives (W-1)/W of the tensor (ring)."""
    device = getattr(cp, "device", None)
    moved = tensor.contiguous() if device is None else tensor.to(device).contiguous()
    Traffic.add((cp.world - 1) / cp.world * nbytes(moved), "reduce_scatter")
    out = moved.new_empty(moved.shape[0] // cp.world, *moved.shape[1:])
    _collective(getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor, cp, out, moved)
    return out.to(tensor.device)


def in_buckets(tensors: list[torch.Tensor], collective, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Run `collective(flat) -> flat` (an in-place all-reduce or broadcast) over `tensors`
    flattened into buckets of up to `bucket_bytes` (one dtype and device per bucket, in
    order), and copy each result back into its tensors. Every rank must pass tensors of
    the same shapes in the same order."""
    bucket: list[torch.Tensor] = []
    held = 0  # bytes in `bucket`

    def flush():
        if bucket:
            flat = collective(torch.cat([t.reshape(-1) for t in bucket]))
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
            bucket.clear()

    for t in tensors:
        size = nbytes(t)
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or held + size > bucket_bytes):
            flush()
            held = 0
        bucket.append(t)
        held += size
    flush()


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


class GradOnFirstRank(torch.autograd.Function):
    """Identity forward; backward passes the gradient on the group's first rank and zeros
    elsewhere. Put in front of a parameter used by a computation replicated on every rank
    (with a replicated upstream gradient) whose parameter gradients are then summed over
    ranks: the sum counts the replicated contribution once, exactly."""

    @staticmethod
    def forward(ctx, x, cp):
        ctx.first = cp.rank == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.first else torch.zeros_like(grad)), None


def gather_rows(x: torch.Tensor, index: list[torch.Tensor], cp) -> torch.Tensor:
    """x [.., n_r, F] of this rank's rows of a chunk -> [.., T, F], every rank's rows in
    chunk order (rank s's rows land at `index[s]`, LongTensor [n_s]): one all-gather, each
    rank's rows padded to the longest. No autograd (`GatherRows` is its differentiable form).

    The gathered rows land with one `index_copy_` (not one indexed write per rank: every
    layer of a divided walk chunk gathers, forward and backward)."""
    counts = [int(i.numel()) for i in index]
    most, lead, width = max(counts), x.shape[:-2], x.shape[-1]
    padded = x
    if x.shape[-2] != most:
        padded = x.new_zeros(*lead, most, width)
        padded[..., : x.shape[-2], :] = x
    stacked = all_gather_stacked(padded, cp)  # [W, .., most, F]
    if min(counts) == most:  # every rank holds as many rows (the deal's usual chunk)
        rows = stacked.movedim(0, -3).reshape(*lead, len(index) * most, width)  # a copy under leading dims
    else:
        rows = torch.cat([stacked[s, ..., :n, :] for s, n in enumerate(counts)], dim=-2)
    del stacked, padded  # two gathered-sized buffers at a time, as the per-rank writes held
    out = x.new_empty(*lead, sum(counts), width)
    return out.index_copy_(out.dim() - 2, torch.cat(index), rows)


class GatherRows(torch.autograd.Function):
    """x [.., n_r, F] of this rank's rows of a chunk -> [.., T, F], every rank's rows in
    chunk order (rank s's rows land at `index[s]`, LongTensor [n_s]; one all-gather, each
    rank's rows padded to the longest).

    Backward keeps this rank's rows of the gradient, without communication: the tensor it
    returns must feed a computation that is replicated on every rank with a replicated
    upstream gradient (the divided reverse walk's attention, whose output gradient is
    summed over ranks first), so every rank's gradient already holds every row in full."""

    @staticmethod
    def forward(ctx, x, index, cp):
        ctx.mine = index[cp.rank]
        return gather_rows(x, index, cp)

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.mine, :], None, None


class MergeAcrossRanks(torch.autograd.Function):
    """(o_r [.., M, Dv], lse_r [.., M]) partial attentions of every rank -> their
    log-sum-exp merge (o, lse), identical on every rank.

    Two all-reduces (`merge_across_ranks`): each rank receives ~2 (W-1)/W of one partial,
    not W - 1 partials, and besides (o, lse) one buffer is alive; the all-reduce hands
    every rank the same bits.

    Backward needs no communication: with w_r = exp(lse_r - lse),
        d o_r   = w_r do
        d lse_r = w_r (do . o_r - do . o + dlse)
    and do, dlse are the same on every rank (the computation after the merge is
    replicated)."""

    @staticmethod
    def forward(ctx, out, lse, cp):
        merged, lse_all = merge_across_ranks(out, lse, cp)
        safe = torch.where(torch.isinf(lse_all), torch.zeros_like(lse_all), lse_all)
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


def merge_across_ranks(out: torch.Tensor, lse: torch.Tensor, cp):
    """The log-sum-exp merge (o, lse) of every rank's partial attention (o_r [.., M, Dv],
    lse_r [.., M]), identical on every rank, in the promoted dtype of the two. No
    autograd (`MergeAcrossRanks` is its differentiable form).

    With m = max_r lse_r (an all-reduce of max) and w_r = exp(lse_r - m), one all-reduce
    sums (w_r o_r, w_r) over ranks: o = sum w_r o_r / sum w_r, lse = m + log(sum w_r).
    Each rank receives 2 (W-1)/W of [.., M, Dv + 2] values (ring all-reduce), where
    broadcasting every rank's partial would take W - 1 of them: at W = 32, 16x less. A
    row that no rank saw (lse = -inf everywhere) gets o = 0, lse = -inf."""
    dtype = torch.promote_types(out.dtype, lse.dtype)
    top = all_reduce_max(lse.to(dtype).clone(), cp)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(lse.to(dtype) - safe)  # (.., M); 0 where this rank saw nothing
    both = all_reduce_sum(torch.cat([out.to(dtype) * w[..., None], w[..., None]], dim=-1), cp)
    total = both[..., -1]
    merged = both[..., :-1] / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return merged, safe + torch.log(total)


def merge_gathered(out: torch.Tensor, lse: torch.Tensor, cp):
    """`merge_across_ranks` in ONE collective, for small partials (a decode step's: o_r
    [Hkv, G*g, Dv], lse_r [Hkv, G*g]), where each collective's latency, not its bytes,
    is the cost: every rank's (o_r, lse_r) is all-gathered (one flat buffer each) and
    merged locally in rank order. Each rank receives W - 1 partials (the two all-reduces:
    ~2 (W-1)/W of one), and holds W of them, so this is for partials of a few KiB, not a
    capture chunk's. Identical on every rank (the same sums in the same order); at W = 2
    bitwise equal to `merge_across_ranks` (a sum of two terms does not depend on their
    order; the max and the rest are the same elementwise ops). No autograd."""
    dtype = torch.promote_types(out.dtype, lse.dtype)
    n = out.numel()
    parts = all_gather(torch.cat([out.to(dtype).reshape(-1), lse.to(dtype).reshape(-1)]), cp)  # W x (n + M)
    outs = [part[:n].view(out.shape) for part in parts]  # (.., M, Dv) each
    lses = [part[n:].view(lse.shape) for part in parts]  # (.., M) each
    top = lses[0]
    for other in lses[1:]:
        top = torch.maximum(top, other)
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    num = total = None
    for o, part_lse in zip(outs, lses):
        w = torch.exp(part_lse - safe)  # (.., M); 0 where that rank saw nothing
        num = o * w[..., None] if num is None else num + o * w[..., None]
        total = w if total is None else total + w
    merged = num / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return merged, safe + torch.log(total)


def _global_rank(cp, group_rank: int) -> int:
    if cp.group is None or cp.group == dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(cp.group, group_rank)


def broadcast_from_first(tensor: torch.Tensor, cp) -> torch.Tensor:
    """Overwrite `tensor` on every rank with that of the group's first rank, in place
    (through the backend's device when it differs); returns the tensor."""
    device = getattr(cp, "device", None)
    moved = tensor if device is None or tensor.device == device else tensor.to(device)
    _collective(dist.broadcast, cp, moved, src=dist.get_global_rank(cp.group, 0))
    return tensor if moved is tensor else tensor.copy_(moved)


def broadcast_from(tensor: torch.Tensor, src: int, cp) -> torch.Tensor:
    """Rank `src`'s `tensor` on every rank: the source passes its tensor, the others a
    buffer of the same shape that is overwritten (through the backend's device when it
    differs); returns it."""
    device = getattr(cp, "device", None)
    moved = tensor.contiguous() if device is None else tensor.to(device).contiguous()
    Traffic.add(0 if src == cp.rank else nbytes(moved), "broadcast")
    _collective(dist.broadcast, cp, moved, src=_global_rank(cp, src))
    return moved if moved.device == tensor.device else moved.to(tensor.device)


def send_to(tensor: torch.Tensor, dst: int, cp):
    """Start sending `tensor` to rank `dst` (point to point); returns a function that waits
    for the send to finish (keep the tensor alive until then)."""
    device = getattr(cp, "device", None)
    moved = tensor.contiguous() if device is None else tensor.to(device).contiguous()
    work = _collective(dist.isend, cp, moved, dst=_global_rank(cp, dst))

    def wait():
        try:
            work.wait()
        except (RuntimeError, ValueError) as exc:
            raise DistributedError(f"context-parallel send to rank {dst} failed on the "
                                   f"{getattr(cp, 'backend', '?')} backend ({exc})") from exc
        return moved
    return wait


def recv_from(buffer: torch.Tensor, src: int, cp) -> torch.Tensor:
    """Receive rank `src`'s tensor into a buffer of its shape and dtype; returns it."""
    device = getattr(cp, "device", None)
    moved = buffer if device is None or buffer.device == device else buffer.to(device)
    Traffic.add(nbytes(moved), "recv")
    _collective(dist.recv, cp, moved, src=_global_rank(cp, src))
    return moved if moved.device == buffer.device else moved.to(buffer.device)
