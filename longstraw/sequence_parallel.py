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

What stays replicated: replay of the branches (R-sized, against the sharded state as
before), exact mode's reverse walk (it recomputes chunk by chunk through all layers,
with autograd, attending over the sharded state as before), captures that keep chunk
graphs (`keep_graph_bytes`), captures of an offloaded state, and rollouts' decode. Because
replay and the walk are replicated and capture runs without autograd, every parameter
gradient is still complete on every rank and no parameter gradient is reduced (FSDP2's
reduce-scatter remains the only reduction). See docs/distributed.md.
"""

from __future__ import annotations

import torch

from .models.divided import Divided
from .state import PromptState, Shard


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
        adapter.run(own, 0, [state], phase="divided", block_size=block_size, divided=divided)
    state.length = n

