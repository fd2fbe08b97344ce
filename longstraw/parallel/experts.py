"""Expert parallelism over the context-parallel group (`ExecConfig(expert_parallel=True)`):
the geometry of the experts' slices and the two combines of an MoE call. The models'
side (which HF modules are experts, which phase a call is in) is `models/experts.py`;
the design: `longstraw.parallel`; users' guide: docs/distributed.md.

Rank r of W holds experts [lo_r, hi_r) = [r E // W, (r+1) E // W) of each MoE layer's
E (uneven when W does not divide E: the slices differ by at most one expert), as slices
of HF's own 3-D parameters (`gate_up_proj` [E, 2I, H] -> [hi - lo, 2I, H]). An MoE call
runs the model's own router on every rank's tokens as today, then HF's own experts
forward over the local slices, with every top-k choice outside [lo, hi) sent to HF's
sentinel (index hi - lo, which its forward skips), and combines the ranks' partials:

    replicated tokens  (replay, score, decode, a replicated capture or walk: the same
                       tokens on every rank)
        forward   y = sum_r y_r: one all-reduce of [T, H] (`SumAcrossRanks`)
        backward  dy is replicated, so each rank's local experts get their whole
                  gradient with no communication; the inputs' gradients (hidden [T, H]
                  and routing weights [T, k]) are partial: one all-reduce
                  (`SumGradsAcrossRanks`)
    divided tokens     (a divided capture or reverse walk: each rank its own rows, n_r)
        forward   all-gather every rank's (hidden, weights, top-k) padded to the longest
                  m = max n_s (`GatherPadded`), local experts over all W m rows, one
                  reduce-scatter hands each rank the sum over ranks of its own rows
                  (`ScatterPadded`)
        backward  the mirror: all-gather of the output gradient, local backward, one
                  reduce-scatter of the inputs' gradients

An expert's parameter gradient is therefore complete on its owner in every phase: it is
left out of every cross-rank gradient sum (`is_expert_shard`, read by `gradients.py`
and the replica check). Each rank receives per MoE layer and per token about
2 (W-1)/W T H values (replicated, forward) or 2 (W-1) n H (divided, forward), the
planner's `plan.traffic.expert_parallel_bytes`.

Every rank must make the same MoE calls in the same order (collectives pair up): a
rank whose local experts no token chose still takes part, and keeps a zero path to its
inputs so that its backward meets the others' (`touch`).
"""

from __future__ import annotations

import torch

from longstraw.parallel.collectives import all_gather, all_reduce_sum, reduce_scatter_sum

SHARD_ATTR = "_longstraw_expert_shard"
"""The attribute an expert-parallel parameter carries: (lo, hi, experts, world)."""


def expert_bounds(experts: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s experts [lo, hi) of `experts` over `world` ranks: floor splits, so
    the slices differ by at most one expert."""
    return rank * experts // world, (rank + 1) * experts // world


def is_expert_shard(param) -> bool:
    """Whether `param` is a slice of an MoE layer's experts held by this rank alone."""
    return getattr(param, SHARD_ATTR, None) is not None


def local_routing(index: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Global top-k expert ids [T, k] -> ids into this rank's slice [lo, hi); every other
    choice (and an id already past the experts) becomes the sentinel hi - lo."""
    inside = (index >= lo) & (index < hi)
    return torch.where(inside, index - lo, torch.full_like(index, hi - lo))


def touch(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """out, given a zero-valued path to every input that needs a gradient when it has
    none (no local expert was chosen: HF's forward returned zeros_like), so that this
    rank's backward reaches the inputs' collective as every other rank's does."""
    if not torch.is_grad_enabled() or out.grad_fn is not None:
        return out
    needed = [x for x in inputs if x.requires_grad]
    if not needed:
        return out
    return out + sum(x.sum() for x in needed) * 0.0


# ----------------------------------------------------------------------------
# replicated tokens


class SumAcrossRanks(torch.autograd.Function):
    """Forward: the sum over ranks (one all-reduce). Backward: identity (the upstream
    gradient is replicated, and each rank's partial took its whole share of the sum).
    It saves its output, so that a layer-wise recompute (`models/recompute.py`, which
    stops once every saved tensor is back) runs this collective on every rank."""

    @staticmethod
    def forward(ctx, x, cp):
        out = all_reduce_sum(x.contiguous().clone(), cp)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SumGradsAcrossRanks(torch.autograd.Function):
    """Identity forward on several tensors; backward sums their gradients over ranks in
    one all-reduce (they feed this rank's partial of a replicated computation)."""

    @staticmethod
    def forward(ctx, cp, *xs):
        ctx.cp = cp
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = all_reduce_sum(torch.cat([g.reshape(-1) for g in grads]), ctx.cp)  # the promoted dtype
        parts = flat.split([g.numel() for g in grads])
        return (None, *(part.view_as(g).to(g.dtype) for part, g in zip(parts, grads)))


def combine_replicated(experts_forward, hidden, index, weights, lo: int, hi: int, cp) -> torch.Tensor:
    """hidden [T, H], index [T, k] (global expert ids), weights [T, k], the same on every
    rank -> the MoE output [T, H] over every rank's experts, the same on every rank.
    `experts_forward(hidden, local_index, weights)` is HF's own forward over the local
    slices."""
    hidden, weights = SumGradsAcrossRanks.apply(cp, hidden, weights)
    out = touch(experts_forward(hidden, local_routing(index, lo, hi), weights), hidden, weights)  # (T, H)
    return SumAcrossRanks.apply(out, cp)


# ----------------------------------------------------------------------------
# divided tokens


class GatherPadded(torch.autograd.Function):
    """xs [n, F_i] of this rank's rows -> [W m, F_i] each: rank s's rows at s m .., each
    rank's padded with zeros to m = max(counts); one all-gather per tensor (they may
    differ in dtype: HF routes in float32). Backward: one reduce-scatter per tensor
    (every rank's gradient of this rank's rows, summed), unpadded to n."""

    @staticmethod
    def forward(ctx, cp, counts, *xs):
        ctx.cp, ctx.n = cp, xs[0].shape[0]
        return tuple(torch.cat(all_gather(_pad_rows(x, max(counts)), cp)) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(reduce_scatter_sum(g, ctx.cp)[: ctx.n] for g in grads))


class ScatterPadded(torch.autograd.Function):
    """y [W m, F], a partial over every rank's padded rows -> [n, F]: this rank's rows,
    summed over ranks (one reduce-scatter). Backward: one all-gather of the gradient,
    each rank's padded to m. It saves its output (see `SumAcrossRanks`)."""

    @staticmethod
    def forward(ctx, y, n, cp):
        ctx.cp, ctx.most = cp, y.shape[0] // cp.world
        out = reduce_scatter_sum(y, cp)[:n]  # (n, F)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(all_gather(_pad_rows(grad, ctx.most), ctx.cp)), None, None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    out = x.new_zeros(rows, *x.shape[1:])
    out[: x.shape[0]] = x
    return out


def combine_divided(experts_forward, hidden, index, weights, lo: int, hi: int, experts: int, counts: list[int],
                    cp) -> torch.Tensor:
    """hidden [n, H], index [n, k] (global expert ids), weights [n, k]: this rank's own
    rows (`counts`: every rank's n, in rank order) -> the MoE output of its own rows
    [n, H] over every rank's experts. `experts_forward` as in `combine_replicated`;
    `experts` (E) is the sentinel the padding rows route to."""
    n, most = hidden.shape[0], max(counts)
    every, every_weights = GatherPadded.apply(cp, counts, hidden, weights)  # (W m, H), (W m, k)
    every_index = torch.cat(all_gather(_pad_rows(index, most).index_fill_(0, _tail(n, most, index.device), experts),
                                       cp))  # (W m, k): padding rows choose no expert
    out = touch(experts_forward(every, local_routing(every_index, lo, hi), every_weights), every, every_weights)
    return ScatterPadded.apply(out, n, cp)  # (n, H)


def _tail(n: int, most: int, device) -> torch.Tensor:
    return torch.arange(n, most, device=device)
