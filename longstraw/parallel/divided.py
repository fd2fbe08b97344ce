"""The divided capture and the divided reverse walk's chunks: under context parallelism
each prompt token is computed (and, in exact mode, recomputed and backpropagated) on the
rank that owns its block. The design: `longstraw.parallel`.

* `divided_capture` runs the model's decoder stack once, layer by layer, over this rank's
  positions into the sharded state (each family's module in `models/` holds its divided phases; `parallel/chunks.py` what they read).
* `snapshot_positions`: where the GDN layers keep the snapshots capture records.
* `walk_chunks` / `divided_chunks`: the chunks of a divided reverse walk (whole cycles of
  the deal), each with this rank's `DividedChunk`.

The walk's gradient sums live in `gradients.py` and `fsdp.py`; docs/distributed.md.
"""

from __future__ import annotations

import torch

from longstraw.parallel.chunks import Divided, DividedChunk
from longstraw.phase import Phase
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
    on the rank that owns it. Every rank calls it with the same ids. An offloaded state
    (`state.offload`): each rank writes its own rows straight into their host rows (the
    layer's attention reads the rows computed in this pass, exchanged between ranks, never
    the state), so nothing is staged in."""
    n = ids.shape[0]
    divided = Divided(total=n, rank=shard.rank, world=shard.world, block=shard.block, cp=shard.cp,
                      snapshots=snapshot_positions(n, chunk_size, exact), chunk_size=chunk_size)
    own = ids[divided.positions(ids.device)]  # (N,)
    with torch.no_grad():
        adapter.run(own, 0, [state], phase=Phase.DIVIDED, block_size=block_size, divided=divided)
    state.length = n
    if state.offload is not None:
        state.offload.count_written()


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
