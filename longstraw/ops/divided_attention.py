"""Causal attention of a rank's own prompt positions over every rank's keys (divided capture).

Under context parallelism the prompt is dealt in blocks of B positions, block b to rank
b % W. In a divided capture each rank runs a layer over its own positions only, so it
holds the queries, keys and values of its own blocks. A query of block b sees:

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

from ..tensors import accumulation_dtype
from .attention import PrefixAttention
from .collectives import broadcast_from
from .flash import fused_kernel, fused_takes, merge_partials


def rows_before(position: int, rank: int, world: int, block: int) -> int:
    """Rows of rank `rank`'s shard at positions before `position` (as `state.Shard.count`)."""
    cycle = block * world
    full, rem = divmod(max(position, 0), cycle)
    return full * block + min(max(rem - rank * block, 0), block)


def _partial(q, k, v, scale: float, causal: bool):
    """(o [Hkv, g*T, Dv], lse [Hkv, g*T]) of q [H, T, D] over k, v [Hkv, S, D] (row layout:
    head j*g+i is row block i of kv head j), in the accumulation dtype."""
    h, t, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    acc = accumulation_dtype(q.dtype)
    flash = fused_kernel(q.device.type, q.dtype) if fused_takes(q, v.shape[-1], None) else None
    if flash is not None:
        if causal:
            out, lse = flash(q[None], k.repeat_interleave(g, 0)[None], v.repeat_interleave(g, 0)[None], True, scale)
        else:
            out, lse = flash(q.reshape(1, hkv, g * t, d), k[None], v[None], False, scale)
        return out[0].reshape(hkv, g * t, -1).to(acc), lse[0].reshape(hkv, g * t).to(acc)
    rows = q.reshape(hkv, g * t, d)
    q_pos = torch.arange(t, device=q.device).repeat(g)
    return PrefixAttention.apply(rows, k, v, q_pos, 0, scale, None, max(1, k.shape[1]), None, causal)


@torch.no_grad()
def divided_causal_attention(q, k, v, *, positions: int, rank: int, world: int, block: int, scale: float, cp,
                             piece_rows: int):
    """Attention of this rank's own positions over all earlier positions of all ranks.

    Args:
        q: [H, N, D] queries of this rank's positions (its blocks, in order).
        k, v: [Hkv, N, D] / [Hkv, N, Dv] keys and values of the same positions.
        positions: the sequence length (positions 0 .. positions - 1 are dealt).
        rank, world, block: the round-robin deal (block b on rank b % world).
        scale: softmax scale. cp: the `distributed.ContextParallel` (None with one rank).
        piece_rows: rows of another rank's shard fetched at a time.

    Returns:
        [H, N, Dv] in q's dtype. Every rank must call it (the shards are broadcast).
    """
    h, n, d = q.shape
    hkv = k.shape[0]
    starts = [b * block for b in range(rank, -(-positions // block), world)]  # own blocks' first positions
    spans = [(i * block, min(n, (i + 1) * block)) for i in range(len(starts))]  # their local rows
    # the diagonal: each own block over itself, causal
    parts = [_partial(q[:, a:b], k[:, a:b], v[:, a:b], scale, True) for a, b in spans]
    for src in range(world):
        rows = rows_before(positions, src, world, block)
        for r0 in range(0, rows, piece_rows):
            r1 = min(rows, r0 + piece_rows)
            if src == rank:  # our own rows: send them to the others
                pk, pv = k[:, r0:r1], v[:, r0:r1]
                if world > 1:
                    broadcast_from(pk, src, cp)
                    broadcast_from(pv, src, cp)
            else:
                pk = broadcast_from(k.new_empty(hkv, r1 - r0, d), src, cp)
                pv = broadcast_from(v.new_empty(hkv, r1 - r0, v.shape[-1]), src, cp)
            for i, ((a, b), first) in enumerate(zip(spans, starts)):
                seen = min(rows_before(first, src, world, block), r1) - r0  # rows of the piece this block sees
                if seen <= 0:
                    continue
                o_p, lse_p = _partial(q[:, a:b], pk[:, :seen], pv[:, :seen], scale, False)
                o, lse = parts[i]
                parts[i] = (merge_partials(o_p, lse_p, o, lse), torch.logaddexp(lse_p, lse))
    out = [o.reshape(h, b - a, -1) for (o, _), (a, b) in zip(parts, spans)]
    return torch.cat(out, dim=1).to(q.dtype) if out else q.new_zeros(h, 0, v.shape[-1])
