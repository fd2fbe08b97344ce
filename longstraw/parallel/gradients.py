"""Parameter gradients under context parallelism: the divided reverse walk's partial
gradients summed over ranks (`partial_gradients`), and replay's replicated gradients made
the first rank's on every rank (`replicate_gradients`). The design: `longstraw.parallel`.

Each runs bucketed collectives over flattened `.grad`s (`collectives.in_buckets`), after
checking that every rank pairs the same layout (`same_gradient_layout`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from longstraw.defaults import GRADIENT_BUCKET_BYTES
from longstraw.errors import DistributedError
from longstraw.host import on_host
from longstraw.parallel.collectives import all_gather, all_reduce_sum, broadcast_from, in_buckets
from longstraw.parallel.experts import is_expert_shard


def same_gradient_layout(grads: list[torch.Tensor], cp, what: str) -> None:
    """Raise `DistributedError` on every rank, together, unless every rank holds the same
    number of gradients with the same number of elements (what a bucketed collective
    pairs); `what` names the phase in the message."""
    with on_host():  # host-known counts: real tensors in a rehearsal too (`longstraw.host`)
        sizes = all_gather(torch.tensor([float(len(grads)), float(sum(g.numel() for g in grads))],
                                        dtype=torch.float64), cp)
        same = all(torch.equal(x, sizes[0]) for x in sizes)
    if not same:
        raise DistributedError(f"{what} left different parameter gradients on the ranks (count, elements per rank: "
                               f"{[x.tolist() for x in sizes]}); every rank must run the same model")


@contextlib.contextmanager
def partial_gradients(params, cp, bucket_bytes: int = GRADIENT_BUCKET_BYTES):
    """Within the block, backward adds a partial gradient on each rank (the divided walk:
    each rank's own tokens); at its end every `.grad` holds the sum over ranks, added to
    what the first rank held before.

    On entry every rank sets its `.grad`s aside, so backward writes the partials into
    fresh buffers (one more gradient's worth of memory during the walk). At the end the
    first rank adds what it held before, and one all-reduce, in buckets of up to
    `bucket_bytes` of flattened gradients, sums every `.grad` over ranks; the other
    ranks' earlier gradients are dropped. The earlier gradient (replay's and earlier
    steps') is thus counted once and is the first rank's on every rank: the ranks' `.grad`
    agree by construction even where replay's backward summed in a different order on
    each (`index_add_` with repeated indices on CUDA). No parameter gradient is reduced
    twice, and nothing but this all-reduce reduces them.

    If the block or the sum raises, every rank's `.grad` is put back as it was on entry
    (the same tensors, unchanged), and the error propagates."""
    params = [p for p in params if p.requires_grad]
    before = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
        for p, held in zip(params, before):
            if held is None:
                continue
            if p.grad is None:  # the walk did not reach it on this rank: a zero partial, same layout everywhere
                p.grad = held.clone() if cp.rank == 0 else torch.zeros_like(held)
            elif cp.rank == 0:
                p.grad.add_(held)
        grads = [p.grad for p in params if p.grad is not None]
        same_gradient_layout(grads, cp, "the divided reverse walk")
        in_buckets(grads, lambda flat: all_reduce_sum(flat, cp), bucket_bytes)
    except BaseException:
        for p, held in zip(params, before):
            p.grad = held
        raise


def replicated_parameters(model) -> list:
    """The parameters every rank holds whole: all but FSDP2's DTensor shards and expert
    parallelism's slices (`experts.is_expert_shard`: their gradients are complete on their
    owner, and summing or broadcasting them across ranks would mix different experts)."""
    return [p for p in model.parameters() if not isinstance(p, DTensor) and not is_expert_shard(p)]


def replicate_gradients(params, cp, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Every `.grad` of `params` becomes the first rank's, on every rank: one broadcast, in
    buckets of up to `bucket_bytes` of flattened gradients.

    For gradients that every rank computes alike (replay, a replicated walk) and that
    should be bitwise equal, but are not where backward sums in a nondeterministic order
    (`index_add_` with repeated indices on CUDA: DSA's backward, HF's eager MoE). Each
    rank receives one gradient's worth of bytes; a bitwise-equal gradient is unchanged."""
    grads = [p.grad for p in params if p.requires_grad and p.grad is not None]
    same_gradient_layout(grads, cp, "replay")
    in_buckets(grads, lambda flat: broadcast_from(flat, 0, cp), bucket_bytes)
