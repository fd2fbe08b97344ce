"""Causal attention of a rank's own prompt positions over every rank's keys (the divided
capture; the design: `longstraw.parallel`), for attention and absorbed MLA (DSA's: `parallel.divided_dsa`).

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
from longstraw.tensors import accumulation_dtype
from longstraw.parallel.collectives import broadcast_from
from longstraw.parallel.deal import Deal
from longstraw.ops.divided_runs import divided_attention_runs, merge_into, partial_attention
from longstraw.ops.flash import fused_takes, merge_sink


def piece_spans(deal: Deal, positions: int, piece_rows: int) -> list[tuple[int, int, int]]:
    """The pieces `shard_pieces` fetches, in its order: (src, r0, r1), rows r0 .. r1 - 1 of
    rank src's shard of `positions` positions (on the host)."""
    spans = []
    for src in range(deal.world):
        n = deal.count(positions, src)
        spans += [(src, r0, min(n, r0 + piece_rows)) for r0 in range(0, n, piece_rows)]
    return spans


def shard_pieces(rows: list, *, positions: int, rank: int, deal: Deal, cp, piece_rows: int):
    """Every rank's shard of `rows` (tensors with the row axis at dim -2; this rank passes its
    own N rows) under `deal`, piece by piece in rank order: yields (src, r0, r1, pieces), the
    rows r0 .. r1 - 1 of rank src's shard of each tensor. The source broadcasts them, the
    others receive them; every rank must iterate to the end (memory: one piece)."""
    world = deal.world
    for src, r0, r1 in piece_spans(deal, positions, piece_rows):
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
