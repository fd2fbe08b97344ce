"""DSA under context parallelism, in a divided capture: the indexer's global top-k of each
rank's own queries over every rank's indexer keys, and the sparse attention over the
latent rows it selects, which lie on every rank. Each rank's shard is fetched piece by
piece (`parallel.attention.shard_pieces`, memory: one piece), forward only.

The sparse attention runs with one read of device data per call (per layer), whatever the
number of pieces: which of a rank's queries take rows of each piece, and the most rows one
takes, are counted for every piece at once and read to the host together (`host.to_host`).
A rehearsal (fake tensors, no data) cannot count them; it assumes each query's K entries
spread evenly over the pieces it sees, but the first such piece as wide as it can be (K
rows, or the piece's), so the widest block of the real run is rehearsed once.

Legend: H query heads, N own positions, D latent key dim (kv_lora_rank + rope), Dv value
dim (kv_lora_rank), K top-k, Hi/Di indexer heads/dim.
"""

from __future__ import annotations

import math

import torch

from longstraw.defaults import DIVIDED_SPARSE_ENTRIES, DIVIDED_SPARSE_QUERIES
from longstraw.host import to_host
from longstraw.parallel.attention import piece_spans, shard_pieces
from longstraw.parallel.deal import Deal
from longstraw.parallel.indexer_pieces import indexer_piece_topk
from longstraw.parallel.sparse_pieces import divided_sparse_piece
from longstraw.tensors import accumulation_dtype

__all__ = ["divided_indexer_topk", "divided_sparse_attention"]

STATS_QUERY_BLOCK = 4096  # queries counted at once: a [block, 2 x pieces] int64 temporary


@torch.no_grad()
def divided_indexer_topk(q_idx, weights, keys, topk: int, *, scale: float, positions: int, rank: int, world: int,
                         block: int, cp, piece_rows: int, query_block: int = 1024, key_block: int = 128):
    """DSA's selection for this rank's own queries over every rank's indexer keys: exactly
    `dsa.indexer_topk`'s of one process (best score first, ties to the lower position),
    since that order is total and the top-k of a union is the top-k of its parts' top-ks.

    Args:
        q_idx: [N, Hi, Di] indexer queries of this rank's positions (float32: HF scores in it).
        weights: [N, Hi] head weights (HF's n_heads**-0.5 included). keys: [N, Di] own keys.
        positions, rank, world, block, cp, piece_rows: as `divided_causal_attention`.
        query_block, key_block: queries scored at once, keys per matmul (memory: the block's
            scores and running top-k [query_block, topk + piece_rows], and a
            [query_block, Hi, key_block] temporary).
    Returns:
        LongTensor [N, topk] of absolute positions, -1 padded. Every rank must call it.
    """
    n = q_idx.shape[0]
    device = q_idx.device
    deal = Deal(world, block)
    q_pos = deal.position(torch.arange(deal.count(positions, rank), device=device), rank)  # (N,) increasing
    best = torch.full((n, topk), -1, dtype=torch.long, device=device)
    best_sc = torch.full((n, topk), float("-inf"), dtype=accumulation_dtype(q_idx.dtype), device=device)
    for src, r0, r1, (pk,) in shard_pieces([keys], positions=positions, rank=rank, deal=deal, cp=cp,
                                           piece_rows=piece_rows):
        k_pos = deal.position(torch.arange(r0, r1, device=device), src)  # (n_piece,)
        first_key = deal.position(r0, src)
        blocks = []  # (b0, b1, seen) of the query blocks that see the piece, planned on the host
        for b0 in range(0, n, query_block):
            b1 = min(n, b0 + query_block)
            if deal.position(b1 - 1, rank) < first_key:
                continue  # the whole query block comes before the piece
            # the piece's rows are in increasing position: the block's last query sees a prefix of them
            # (counted from the deal, on the host: no read of device data)
            blocks += [b0, b1, min(r1, deal.count(deal.position(b1 - 1, rank) + 1, src)) - r0]
        if blocks:  # one registered op a piece (`parallel/indexer_pieces.py`)
            indexer_piece_topk(q_idx, weights, pk, q_pos, k_pos, blocks, float(scale), int(key_block), best, best_sc)
    return best


@torch.no_grad()
def divided_sparse_attention(q, k, indices, *, value_dim: int, positions: int, rank: int, world: int, block: int,
                             scale: float, cp, piece_rows: int):
    """Absorbed-MLA attention of this rank's own queries restricted to their DSA selection,
    whose latent rows lie on every rank.

    Each rank's shard of latent rows is fetched piece by piece; the queries that selected
    rows of the piece attend over those rows, in blocks of at most `DIVIDED_SPARSE_QUERIES`
    queries and `DIVIDED_SPARSE_ENTRIES` rows (`sparse_pieces.attend_piece`), and the partials are
    merged by log-sum-exp. Each query's entries are sorted once by where they live, so a
    piece's entries are one run per query.

    Args:
        q: [H, N, D] absorbed queries of this rank's positions. k: [N, D] their latent rows
            (latent | rope key); the value is the first value_dim columns.
        indices: [N, K] absolute positions selected (-1: none), e.g. `divided_indexer_topk`'s.
        positions, rank, world, block, scale, cp, piece_rows: as `divided_causal_attention`.
    Returns:
        [H, N, value_dim] in q's dtype. Every rank must call it.
    """
    h, n, d = q.shape
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(h, n, value_dim, dtype=acc)
    lse = q.new_full((h, n), float("-inf"), dtype=acc)
    # each entry's place in the shards laid end to end (rank 0's rows, then rank 1's, ..),
    # sorted per query: a piece's entries are then one run of each row, found by bisection
    deal = Deal(world, block)
    stride = deal.fullest(positions)  # rank 0 holds the most rows
    safe = indices.clamp(min=0)
    place = deal.owner(safe) * stride + deal.row(safe)
    place = torch.where(indices >= 0, place, world * stride).sort(dim=1).values  # (N, K); -1 entries last
    spans = piece_spans(deal, positions, piece_rows)
    stats = _piece_stats(place, spans, stride, deal=deal, positions=positions, rank=rank)
    for (src, r0, r1, (pk,)), (taking, widest) in zip(shard_pieces([k], positions=positions, rank=rank, deal=deal,
                                                                   cp=cp, piece_rows=piece_rows), stats):
        if taking == 0:
            continue
        rows = max(1, min(DIVIDED_SPARSE_QUERIES, DIVIDED_SPARSE_ENTRIES // widest))  # queries a block
        divided_sparse_piece(q, pk, place, out, lse, src * stride + r0, src * stride + r1, taking, widest, rows,
                             value_dim, float(scale))  # one registered op a piece (`parallel/sparse_pieces.py`)
    return out.to(q.dtype)


def _piece_stats(place, spans, stride: int, *, deal: Deal, positions: int, rank: int) -> list[tuple[int, int]]:
    """Per piece of `spans` (`piece_spans`), (queries with entries in it, the most entries one
    has there), from the sorted places [N, K], read to the host in one sync. A rehearsal's
    stand-in: see the module docstring."""
    n, topk = place.shape
    edges = torch.tensor([src * stride + r0 for src, r0, _ in spans] + [src * stride + r1 for src, _, r1 in spans],
                         device=place.device, dtype=place.dtype)
    taking = torch.zeros(len(spans), dtype=torch.long, device=place.device)
    widest = torch.zeros_like(taking)
    for b0 in range(0, n, STATS_QUERY_BLOCK):
        b1 = min(n, b0 + STATS_QUERY_BLOCK)
        cut = torch.searchsorted(place[b0:b1], edges.expand(b1 - b0, -1).contiguous())  # (b, 2 x pieces)
        count = cut[:, len(spans):] - cut[:, :len(spans)]
        taking += (count > 0).sum(0)
        widest = torch.maximum(widest, count.amax(0))
    # the stand-in: every query that sees a piece takes rows of it; K entries spread evenly
    could = [n - deal.count(deal.position(r0, src), rank) for src, r0, _ in spans]  # own queries at or after it
    spread = math.ceil(n * topk / max(1, sum(could)))
    first = next((i for i, c in enumerate(could) if c > 0), None)
    wide = [0 if c == 0 else min(topk, r1 - r0) if i == first else max(1, min(topk, r1 - r0, spread))
            for i, (c, (_, r0, r1)) in enumerate(zip(could, spans))]
    flat = to_host(torch.cat([taking, widest]), list, stand_in=could + wide)
    return list(zip(flat[:len(spans)], flat[len(spans):]))
