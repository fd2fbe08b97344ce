"""Causal attention of a rank's own prompt positions over every rank's keys (the divided
capture; the design: `longstraw.parallel`), for attention, absorbed MLA and DSA.

In a divided capture each rank holds the queries, keys and values of its own blocks of
the deal (`parallel.deal.Deal`: blocks of B, block b on rank b % W). A query of block b sees:

    its own block          causal (the diagonal)
    every earlier block    in full: on rank s, the first count_s(b * B) rows of its shard

so the only masked tile is the diagonal, and everything else is a plain (unmasked)
partial attention merged by log-sum-exp.

Which is cheaper, fetching keys or merging partials? Fetching every other rank's K/V
moves (W-1)/W * P * Hkv * (D + Dv) values per rank and layer. Merging partials instead
needs every rank's queries elsewhere and their partials back: (W-1)/W * P * H * (D + Dv
+ 1), which is H / Hkv times more under GQA (4 to 16 in the supported families). So we
fetch: each rank's shard is broadcast in pieces of `piece_rows` rows (memory: one piece,
not a whole shard), and every rank attends its own queries to the rows of the piece they
can see.

Legend: H query heads, Hkv kv heads, g = H / Hkv, N own positions, D head dim, Dv value
dim. Forward only (capture runs without autograd).
"""

from __future__ import annotations

import torch

from longstraw.defaults import DIVIDED_QUERY_ROWS
from longstraw.tensors import KVSegment, accumulation_dtype
from longstraw.parallel.collectives import broadcast_from
from longstraw.parallel.deal import Deal
from longstraw.ops.dsa import indexer_scores, select_candidates, sparse_latent_attention
from longstraw.ops.divided_runs import divided_attention_runs, merge_into, partial_attention
from longstraw.ops.flash import fused_takes, merge_partials, merge_sink


def shard_pieces(rows: list, *, positions: int, rank: int, deal: Deal, cp, piece_rows: int):
    """Every rank's shard of `rows` (tensors with the row axis at dim -2; this rank passes its
    own N rows) under `deal`, piece by piece in rank order: yields (src, r0, r1, pieces), the
    rows r0 .. r1 - 1 of rank src's shard of each tensor. The source broadcasts them, the
    others receive them; every rank must iterate to the end (memory: one piece)."""
    world = deal.world
    for src in range(world):
        n = deal.count(positions, src)
        for r0 in range(0, n, piece_rows):
            r1 = min(n, r0 + piece_rows)
            if src == rank:  # our own rows: send them to the others
                pieces = [t[..., r0:r1, :] for t in rows]
                if world > 1:
                    for piece in pieces:
                        broadcast_from(piece, src, cp)
            else:
                pieces = [broadcast_from(t.new_empty(*t.shape[:-2], r1 - r0, t.shape[-1]), src, cp) for t in rows]
            yield src, r0, r1, pieces


def _runs(spans, starts, *, deal: Deal, src: int, r0: int, r1: int, window: int | None, rows: int):
    """The own blocks that see rows of a fetched piece (rows r0 .. r1 - 1 of rank src's shard),
    as runs [(a, b, lo, seen, first)]: local rows a .. b - 1 see the piece's rows lo .. seen - 1;
    `first` is the run's first position. Without a window, consecutive blocks that see the same
    rows (every block after the piece sees it whole) join, up to `rows` rows a run."""
    runs = []
    for (a, b), first in zip(spans, starts):
        seen = min(deal.count(first, src), r1) - r0  # rows of the piece this block sees
        # no query of the block sees a key before first - window + 1 (its first query's window)
        lo = 0 if window is None else max(0, deal.count(first - window + 1, src) - r0)
        if seen <= lo:
            continue
        last = runs[-1] if runs else None
        if window is None and last is not None and last[1] == a and last[3] == seen and b - last[0] <= rows:
            runs[-1] = (last[0], b, lo, seen, last[4])
        else:
            runs.append((a, b, lo, seen, first))
    return runs


@torch.no_grad()
def divided_causal_attention(q, k, v, *, positions: int, rank: int, world: int, block: int, scale: float, cp,
                             piece_rows: int, value_dim: int | None = None, sinks: torch.Tensor | None = None,
                             window: int | None = None, query_rows: int = DIVIDED_QUERY_ROWS):
    """Attention of this rank's own positions over all earlier positions of all ranks.

    Args:
        q: [H, N, D] queries of this rank's positions (its blocks, in order).
        k, v: [Hkv, N, D] / [Hkv, N, Dv] keys and values of the same positions; v None
            with `value_dim`: the value is k's first value_dim columns (absorbed MLA's
            latent rows, which are fetched once, not twice).
        positions: the sequence length (positions 0 .. positions - 1 are dealt).
        rank, world, block: the round-robin deal (block b on rank b % world).
        scale: softmax scale. cp: the `parallel.context.ContextParallel` (None with one rank).
        piece_rows: rows of another rank's shard fetched at a time.
        sinks: [H] sink logits joining each softmax denominator once, after every
            rank's keys are merged (`flash.merge_sink`), or None.
        window: sliding window W (a query at p sees the keys at p - W + 1 .. p, whichever
            rank holds them), or None. A fetched piece's rows wholly before a block's
            window are skipped.
        query_rows: without a window, the blocks that see the same rows of a piece (all
            those after it) attend in one call of up to this many rows (at least a block).

    Returns:
        [H, N, Dv] in q's dtype. Every rank must call it (the shards are broadcast).
    """
    h, n, d = q.shape
    assert v is not None or value_dim is not None, "pass v, or value_dim for latent rows"
    fetched = [k] if v is None else [k, v]

    def values(keys, vals):  # the value rows that go with `keys`
        return keys[..., :value_dim] if v is None else vals

    deal = Deal(world, block)
    own = deal.blocks(rank, positions)  # (first position, end position, first row) of each own block
    starts = [first for first, _, _ in own]
    spans = [(r, r + end - first) for first, end, r in own]  # their local rows
    own_v = values(k, v)
    hkv, dv = k.shape[0], own_v.shape[-1]
    # the running output and log-sum-exp of every own query, in partial_attention's row layout [Hkv, g, N]
    out = q.new_zeros(hkv, h // hkv, n, dv, dtype=accumulation_dtype(q.dtype))
    lse = q.new_full((hkv, h // hkv, n), float("-inf"), dtype=out.dtype)
    # the fused kernel's working set is O(rows): blocks join into runs only there (the blockwise one
    # holds [rows, keys] scores)
    rows = max(query_rows, block) if fused_takes(q, dv, window) else block
    if window is None:  # one registered op for the diagonal, one per fetched piece
        divided_attention_runs(q, k, own_v, out, lse, [x for a, b in spans for x in (a, b, a, b)], scale, True)
    for a, b in ([] if window is None else spans):  # the diagonal: each own block over itself, causal
        o_p, lse_p = partial_attention(q[:, a:b], k[:, a:b], own_v[:, a:b], scale, True, window)
        merge_into(out[:, :, a:b], lse[:, :, a:b], o_p.view(hkv, -1, b - a, dv), lse_p.view(hkv, -1, b - a))
    for src, r0, r1, pieces in shard_pieces(fetched, positions=positions, rank=rank, deal=deal, cp=cp,
                                            piece_rows=piece_rows):
        pk, pv = pieces[0], values(pieces[0], pieces[-1])
        runs = _runs(spans, starts, deal=deal, src=src, r0=r0, r1=r1, window=window, rows=rows)
        if window is None:
            divided_attention_runs(q, pk, pv, out, lse, [x for a, b, lo, seen, _ in runs for x in (a, b, lo, seen)],
                                   scale, False)
            continue
        for a, b, lo, seen, first in runs:
            k_pos = deal.position(torch.arange(r0 + lo, r0 + seen, device=q.device), src)
            o_p, lse_p = partial_attention(q[:, a:b], pk[:, lo:seen], pv[:, lo:seen], scale, False, window, first,
                                           k_pos)
            merge_into(out[:, :, a:b], lse[:, :, a:b], o_p.view(hkv, -1, b - a, dv), lse_p.view(hkv, -1, b - a))
    out, lse = out.reshape(h, n, dv), lse.reshape(h, n)
    if sinks is not None:
        out = merge_sink(out, lse, sinks[:, None])
    return out.to(q.dtype)


# ----------------------------------------------------------------------------
# DSA: the indexer's top-k and the sparse attention it restricts


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
        for b0 in range(0, n, query_block):
            b1 = min(n, b0 + query_block)
            if deal.position(b1 - 1, rank) < first_key:
                continue  # the whole query block comes before the piece
            # the piece's rows are in increasing position: the block's last query sees a prefix of them
            # (counted from the deal, on the host: no read of device data)
            seen = min(r1, deal.count(deal.position(b1 - 1, rank) + 1, src)) - r0
            visible = k_pos[None, :seen] <= q_pos[b0:b1, None]  # (B, seen)
            sc = indexer_scores(q_idx[b0:b1], weights[b0:b1], pk[:seen], scale=scale, key_block=key_block)
            sc.masked_fill_(~visible, float("-inf"))
            cand_pos = torch.cat([best[b0:b1], torch.where(visible, k_pos[None, :seen], -1)], dim=1)
            best[b0:b1], best_sc[b0:b1] = select_candidates(torch.cat([best_sc[b0:b1], sc], dim=1), cand_pos, topk,
                                                            with_scores=True)
    return best


@torch.no_grad()
def divided_sparse_attention(q, k, indices, *, value_dim: int, positions: int, rank: int, world: int, block: int,
                             scale: float, cp, piece_rows: int):
    """Absorbed-MLA attention of this rank's own queries restricted to their DSA selection,
    whose latent rows lie on every rank.

    Each rank's shard of latent rows is fetched piece by piece (as `divided_causal_attention`
    fetches it); the queries that selected rows of the piece attend over those rows
    (`dsa.sparse_latent_attention`, rows addressed within the piece; each query's entries
    are sorted once by where they live, so a piece's entries are one run per query, and the
    gather is as wide as the most any query takes from the piece), and the partials are
    merged by log-sum-exp.

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
    for src, r0, r1, (pk,) in shard_pieces([k], positions=positions, rank=rank, deal=deal, cp=cp,
                                           piece_rows=piece_rows):
        bounds = torch.tensor([src * stride + r0, src * stride + r1], device=q.device).expand(n, 2).contiguous()
        lo, hi = torch.searchsorted(place, bounds).unbind(1)  # (N,) each: the run of this piece's entries
        count = hi - lo
        touched = count.nonzero().squeeze(1)
        if touched.numel() == 0:
            continue
        j = torch.arange(int(count.max()), device=q.device)
        local = place[touched].gather(1, (lo[touched, None] + j).clamp(max=place.shape[1] - 1)) - bounds[0, 0]
        local = torch.where(j < count[touched, None], local, -1)  # (n_touched, widest run): rows of the piece
        none = pk.new_zeros(touched.numel(), d)  # no new-token rows: every entry lies in the piece
        o_p, lse_p = sparse_latent_attention(q[:, touched], none, none[:, :value_dim], local,
                                             prefixes=[KVSegment(pk[None], pk[None, :, :value_dim], 0)],
                                             q_start=r1 - r0, scale=scale, return_lse=True)
        o, l = out[:, touched], lse[:, touched]
        out[:, touched] = merge_partials(o_p, lse_p, o, l)
        lse[:, touched] = torch.logaddexp(lse_p, l)
    return out.to(q.dtype)
