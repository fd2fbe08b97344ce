"""Sequence-parallel (divided) capture: under context parallelism each prompt token is
computed on one rank, the one that owns its block.

Why layer by layer. Capture's usual order is chunk by chunk through all layers, and a
chunk needs every earlier chunk's state in every layer: dividing that order across
ranks needs a wavefront pipeline. Run layer by layer instead, each rank over its own
positions (blocks of B dealt round-robin, block b on rank b % W: the same deal as the
sharded state, so the K/V rows a rank computes are exactly the rows it keeps), and
every layer can divide its work:

    projections, norms, MLP/MoE   on the rank's own N ~ P/W tokens (MLP in pieces of
                                  chunk_size), no communication
    attention                     own K/V into the shard; queries attend over every
                                  rank's rows, fetched piece by piece (broadcast):
                                  (W-1)/W * P * Hkv * (D + Dv) values received per layer
    MLA                           own latent rows into the shard; queries attend over
                                  every rank's latent rows, fetched piece by piece:
                                  (W-1)/W * P * (R + Dr) values per layer
    DSA indexer                   own indexer keys into the shard; the global top-k of
                                  own queries over every rank's keys, fetched piece by
                                  piece ((W-1)/W * P * Di values); the sparse attention
                                  over the selected rows merges each piece's partial
    Gated DeltaNet                per own segment an affine transition of the state,
                                  a relay carries the state across ranks, then each
                                  rank finishes its outputs; the conv's K-1 tail comes
                                  from the previous block's owner; the snapshots every
                                  rank keeps are summed over ranks from their owners

Between layers a rank keeps its shard of the hidden states, [N, d].

Exact mode's reverse walk is divided too (`divided_chunks`, `partial_gradients`):
chunk by chunk (last to first; whole cycles of the deal, or for hybrids the fewest
capture chunks that hold a cycle, since GDN layers
restart from the snapshots at capture-chunk starts), each rank recomputes its own
positions of the chunk through every layer with autograd and backpropagates them.
Attention gathers the chunk's q/k/v rows of every rank, runs the chunk's attention as
the replicated walk does (the part over earlier chunks divided by the sharded state),
except that its own causal part runs for this rank's query rows only (`own_rows`), and
keeps this rank's output rows; a GDN layer projects
its own rows, gathers the chunk's projected rows and runs the conv and the recurrence
over the whole chunk on every rank; an MLA layer gathers the chunk's absorbed queries
and latent rows (and the indexer's inputs, for the same global DSA top-k) and keeps
this rank's output rows, as attention does (`models/attention.py`, `gated_deltanet.py`, `mla.py`). Each rank seeds its
own K/V (latent) rows with the gradients its shard accumulated (the replicated GDN snapshots are seeded on
every rank alike). Its parameter gradients are then partial, and one bucketed
all-reduce per step sums them (`partial_gradients`), or, for FSDP2-sharded layers,
FSDP2's own reduce-scatter, set to sum for the walk (`fsdp_sums_partials`).

What stays replicated: replay of the branches (R-sized, against the sharded state as
before), a walk over kept capture graphs (`keep_graph_bytes`), an offloaded state, or
FSDP2 on a 2-D mesh (`fsdp_sum_factor`), captures that keep
chunk graphs, captures of an offloaded state, and rollouts' decode. Replay's gradients
are complete on every rank; only the divided walk's are summed over ranks. Without a
divided walk, the step ends with one broadcast of the first rank's replicated gradients
(`replicate_gradients`), so ranks whose backward summed in a different order agree. See
docs/distributed.md.
"""

from __future__ import annotations

import contextlib

import torch

from longstraw.errors import DistributedError
from longstraw.models.routing import Divided, DividedChunk, Phase
from longstraw.parallel.collectives import all_gather, all_reduce_sum, broadcast_from, in_buckets
from longstraw.parallel.deal import walk_chunk_bounds
from longstraw.state.prompt import PromptState, Shard


def snapshot_positions(positions: int, chunk_size: int, exact: bool) -> tuple[int, ...]:
    """Where the GDN layers keep a snapshot: the end; exact mode also every chunk start
    (what the reverse walk restarts from), as a chunk-by-chunk capture records them."""
    if not exact:
        return (positions,)
    return tuple(range(chunk_size, positions, chunk_size)) + (positions,)


def divided_capture(adapter, ids: torch.Tensor, state: PromptState, shard: Shard, *, chunk_size: int, exact: bool,
                    block_size: int) -> None:
    """Capture ids [n] (positions 0 .. n-1) into the sharded `state`, each token computed
    on the rank that owns it. Every rank calls it with the same ids."""
    n = ids.shape[0]
    divided = Divided(total=n, rank=shard.rank, world=shard.world, block=shard.block, cp=shard.cp,
                      snapshots=snapshot_positions(n, chunk_size, exact), chunk_size=chunk_size)
    own = ids[divided.positions(ids.device)]  # (N,)
    with torch.no_grad():
        adapter.run(own, 0, [state], phase=Phase.DIVIDED, block_size=block_size, divided=divided)
    state.length = n


# ----------------------------------------------------------------------------
# the divided reverse walk (exact mode)


def walk_chunks(positions: int, chunk_size: int, world: int, block: int, *,
                at_chunks: bool = False) -> list[tuple[int, int]]:
    """The chunks [(start, end)] of a divided reverse walk over `positions` tokens: whole
    cycles of the deal (world * block positions, so every rank owns the same share of a
    chunk), as many as `chunk_size` needs (at least one). With `at_chunks` (a model with
    GDN layers, which restart from the snapshots capture kept at multiples of
    `chunk_size`), the fewest whole capture chunks that hold a cycle instead (the capture
    chunks themselves when `chunk_size` >= a cycle). A chunk of at least a cycle holds a
    block of every rank; a shorter last chunk in which some rank would own nothing joins
    the one before it."""
    return walk_chunk_bounds(positions, chunk_size, world, block, at_chunks)  # the planner's own cut


def divided_chunks(positions: int, chunk_size: int, shard: Shard, *,
                   at_chunks: bool = False) -> list[tuple[int, int, DividedChunk]]:
    """`walk_chunks` with each chunk's `DividedChunk` for this rank: [(start, end, chunk)]."""
    return [(a, b, DividedChunk(start=a, end=b, rank=shard.rank, world=shard.world, block=shard.block, cp=shard.cp,
                                chunk_size=chunk_size))
            for a, b in walk_chunks(positions, chunk_size, shard.world, shard.block, at_chunks=at_chunks)]


def same_gradient_layout(grads: list[torch.Tensor], cp, what: str) -> None:
    """Raise `DistributedError` on every rank, together, unless every rank holds the same
    number of gradients with the same number of elements (what a bucketed collective
    pairs); `what` names the phase in the message."""
    sizes = all_gather(torch.tensor([float(len(grads)), float(sum(g.numel() for g in grads))],
                                    dtype=torch.float64), cp)
    if not all(torch.equal(x, sizes[0]) for x in sizes):
        raise DistributedError(f"{what} left different parameter gradients on the ranks (count, elements per rank: "
                               f"{[x.tolist() for x in sizes]}); every rank must run the same model")


@contextlib.contextmanager
def partial_gradients(params, cp, bucket_bytes: int = 32 << 20):
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
    """The parameters every rank holds whole (all but FSDP2's DTensor shards)."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if not isinstance(p, DTensor)]


def replicate_gradients(params, cp, bucket_bytes: int = 32 << 20) -> None:
    """Every `.grad` of `params` becomes the first rank's, on every rank: one broadcast, in
    buckets of up to `bucket_bytes` of flattened gradients.

    For gradients that every rank computes alike (replay, a replicated walk) and that
    should be bitwise equal, but are not where backward sums in a nondeterministic order
    (`index_add_` with repeated indices on CUDA: DSA's backward, HF's eager MoE). Each
    rank receives one gradient's worth of bytes; a bitwise-equal gradient is unchanged."""
    grads = [p.grad for p in params if p.requires_grad and p.grad is not None]
    same_gradient_layout(grads, cp, "replay")
    in_buckets(grads, lambda flat: broadcast_from(flat, 0, cp), bucket_bytes)


# ----------------------------------------------------------------------------
# FSDP2-sharded layers in a divided walk


def _fsdp_groups(module):
    """An FSDP2 module's parameter groups (torch's private `FSDPParamGroup`s), or None
    when this torch lays them out differently."""
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    groups = getattr(state, "_fsdp_param_groups", None)
    knobs = ("gradient_divide_factor", "force_sum_reduction_for_comms", "reduce_scatter_unused_params", "mesh_info")
    if groups is None or not all(hasattr(g, k) for g in groups for k in knobs):
        return None
    return groups


def fsdp_sum_factor(modules, cp) -> float | None:
    """The divide factor with which FSDP2's reduce-scatter turns a divided walk's partial
    gradients into the right shard: its group's size / W (1: a plain sum when FSDP2 shards
    over the context-parallel ranks themselves; with more ranks, their data-parallel
    average of the per-group sums). None when the walk cannot run divided under these
    modules: a 2-D (HSDP) mesh, groups of different sizes, a context-parallel rank outside
    the FSDP2 group, or a torch whose FSDP2 internals are laid out differently."""
    import torch.distributed as dist

    cp_ranks = set(dist.get_process_group_ranks(cp.group if cp.group is not None else dist.group.WORLD))
    sizes = set()
    for module in modules:
        groups = _fsdp_groups(module)
        if groups is None:
            return None
        for g in groups:
            mesh = g.mesh_info
            if getattr(mesh, "replicate_process_group", None) is not None or not hasattr(mesh, "shard_process_group"):
                return None
            ranks = set(dist.get_process_group_ranks(mesh.shard_process_group))
            if not cp_ranks <= ranks:
                return None
            sizes.add(len(ranks))
    if len(sizes) != 1:
        return None
    return sizes.pop() / cp.world


@contextlib.contextmanager
def fsdp_sums_partials(modules, factor: float):
    """Within the block (a divided walk), FSDP2's reduce-scatter of each module's
    gradients sums the ranks' partial gradients instead of averaging replicated ones:
    divide factor `factor` (`fsdp_sum_factor`), the sum reduction forced (gloo has no
    pre-multiplied sum), and unused parameters reduce-scattered as zeros (a safeguard: a
    parameter that none of this rank's tokens of a chunk reached, say a per-expert module
    of an MoE, would have no gradient here but one on another rank, and every rank must
    send the same layout; HF's fused experts are one parameter, always reached). Each
    module's previous settings are restored on exit."""
    saved = [(g, g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params)
             for m in modules for g in _fsdp_groups(m)]
    for g, *_ in saved:
        g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params = factor, True, True
    try:
        yield
    finally:
        for g, factor0, force0, unused0 in saved:
            g.gradient_divide_factor, g.force_sum_reduction_for_comms, g.reduce_scatter_unused_params = (
                factor0, force0, unused0)


@contextlib.contextmanager
def summed_walk_gradients(model, cp, fsdp_modules):
    """A divided walk's parameter gradients, each summed over ranks once: FSDP2-sharded
    parameters (`fsdp_modules`, which `fsdp_sum_factor` must accept) by FSDP2's own
    reduce-scatter (`fsdp_sums_partials`, as each chunk's backward ends), every other
    (replicated) parameter by `partial_gradients`' one bucketed all-reduce after the walk."""
    replicated = replicated_parameters(model)
    fsdp = fsdp_sums_partials(fsdp_modules, fsdp_sum_factor(fsdp_modules, cp)) if fsdp_modules else None
    with fsdp or contextlib.nullcontext(), partial_gradients(replicated, cp):
        yield
