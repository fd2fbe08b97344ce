"""A divided capture's DSA attention over one fetched piece of latent rows, as one registered
op: `longstraw::divided_sparse_piece`.

`divided_dsa.divided_sparse_attention` fetches every rank's latent rows piece by piece; the
queries that selected rows of a piece attend over them in blocks of queries, and each
block's partial is merged by log-sum-exp into the running output. Every query's K entries
spread over the pieces it sees, so at the paper's P = 2.1M on 32 ranks nearly every query
takes rows of nearly every piece: ~64 blocks a piece, 510 pieces a layer, each block a
dozen ops. As one op it is one call per piece to anything that watches ops: its
temporaries are declared as its workspace (`ops/workspace.py`: an upper bound of the loop's
measured peak, tests/parallel/test_sparse_pieces.py) and its matmuls as its FLOP formula.
The real implementation is the plain loop (`attend_piece`).

    longstraw::divided_sparse_piece(q, rows, place, out(a!), lse(b!), lo, hi, taking,
                                    widest, block, value_dim, scale) -> ()

Shapes: q [H, N, D] this rank's absorbed queries; rows [n, D] the fetched piece (latent |
rope; the value is the first value_dim columns); place [N, K] int64 each query's selected
entries as places in the shards laid end to end, sorted per query (`divided_dsa`); the
piece holds places lo .. hi - 1; out [H, N, value_dim], lse [H, N] (accumulation dtype)
the running output, merged into in place. On the host: taking (queries with entries in the
piece), widest (the most entries one has there), block (queries attended at once).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.ops.flash import merge_partials
from longstraw.ops.workspace import declare_workspace
from longstraw.tensors import accumulation_dtype

Tensor = torch.Tensor


def piece_attention(q, rows, local, value_dim: int, scale: float):
    """q [H, B, D] over `rows` [n, D] (a fetched piece; the value is the first value_dim
    columns) at local [B, w] (row ids, -1: none; every query has one at least): (o [H, B,
    value_dim], lse [H, B]) in the accumulation dtype. Memory: the gathered [B, w, D] rows
    and the [H, B, w] scores."""
    acc = accumulation_dtype(q.dtype)
    kb = rows.index_select(0, local.clamp(min=0).reshape(-1)).view(*local.shape, rows.shape[-1]).to(acc)
    s = torch.einsum("hbd,bwd->hbw", q.to(acc), kb).mul_(scale)
    s.masked_fill_((local < 0)[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s.sub_(lse[..., None]))
    return torch.einsum("hbw,bwv->hbv", p, kb[..., :value_dim]), lse


def attend_piece(q, rows, place, out, lse, lo: int, hi: int, taking: int, widest: int, block: int, value_dim: int,
                 scale: float) -> None:
    """The plain loop (the op's implementation): the queries with entries in places
    lo .. hi - 1, `block` at a time, attend over their entries' rows of the piece; each
    block's partial is merged into out, lse."""
    n, topk = place.shape
    bounds = torch.tensor([lo, hi], device=q.device).expand(n, 2).contiguous()
    first, last = torch.searchsorted(place, bounds).unbind(1)  # (N,) each: the run of this piece's entries
    count = last - first
    touched = torch.nonzero_static(count > 0, size=taking).squeeze(1)  # size known: no wait for the device
    j = torch.arange(widest, device=q.device)
    for t0 in range(0, taking, block):
        tb = touched[t0:t0 + block]
        local = place[tb].gather(1, (first[tb, None] + j).clamp(max=topk - 1)) - lo
        local = torch.where(j < count[tb, None], local, -1)  # (b, widest): rows of the piece
        o_p, lse_p = piece_attention(q[:, tb], rows, local, value_dim, scale)
        o, l = out[:, tb], lse[:, tb]
        out.index_copy_(1, tb, merge_partials(o_p, lse_p, o, l))
        lse.index_copy_(1, tb, torch.logaddexp(lse_p, l))
        del tb, local, o_p, lse_p, o, l


@torch.library.custom_op("longstraw::divided_sparse_piece", mutates_args=("out", "lse"))
def divided_sparse_piece(q: Tensor, rows: Tensor, place: Tensor, out: Tensor, lse: Tensor, lo: int, hi: int,
                         taking: int, widest: int, block: int, value_dim: int, scale: float) -> None:
    attend_piece(q, rows, place, out, lse, lo, hi, taking, widest, block, value_dim, scale)


@divided_sparse_piece.register_fake
def _(q, rows, place, out, lse, lo, hi, taking, widest, block, value_dim, scale):
    return None


def workspace_bytes(q, rows, place, out, lse, lo, hi, taking, widest, block, value_dim, scale) -> int:
    """The most bytes `attend_piece` holds at once (an upper bound of its measured peak:
    tests/parallel/test_sparse_pieces.py): the piece's bisection ([N, 2] bounds and cuts, the
    [N] counts, the touched queries and the [w] range), beside the largest block of b
    queries' widest stage: finding its rows (a [b, K] copy of its places and three [b, w]
    int64 temporaries), attending (its rows [b, w] and their clamp, the gathered [b, w, D]
    rows with their cast, its queries [H, b, D] with their cast, scores and probabilities
    [H, b, w], the partial [H, b, Dv]) or merging (the partial, the running rows [H, b, Dv]
    and three products of their size, and the [H, b] log-sum-exps)."""
    if taking == 0:
        return 0
    h, n, d = q.shape
    topk, a = place.shape[1], out.element_size()
    b, w, dv = min(block, taking), widest, value_dim
    piece = 16 + 32 * n + 8 * n + 8 * taking + 8 * w + n

    def cast(x):
        return 0 if x.element_size() == a and x.dtype.is_floating_point else a

    find = 8 * b * topk + 8 * b + 16 * b * w
    kb = b * w * d * (a if cast(rows) else rows.element_size())  # the gathered rows, in the accumulation dtype
    attend = 8 * b * w + h * b * d * q.element_size() + max(
        8 * b * w + b * w * d * (rows.element_size() + cast(rows)),  # the gather and its cast
        kb + h * b * d * cast(q) + h * b * w * a,  # the scores' einsum
        kb + (2 * h * b * w + h * b * dv + h * b) * a)  # the probabilities and the partial
    merge = 8 * b * w + (5 * h * b * dv + 4 * h * b) * a
    return piece + max(find, attend, merge)


declare_workspace(torch.ops.longstraw.divided_sparse_piece.default, workspace_bytes)


@register_flop_formula(torch.ops.longstraw.divided_sparse_piece)
def _flops(q_shape, rows_shape, place_shape, running_shape, lse_shape, lo, hi, taking, widest, block, value_dim, scale,
           *args, **kwargs) -> int:
    """The blocks' two einsums, 2 H w (D + Dv) a query taking rows of the piece."""
    h, _, d = q_shape
    return 2 * h * taking * widest * (d + value_dim)
