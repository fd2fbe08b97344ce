"""DeepSeek Sparse Attention (DSA) over the MLA latent: the indexer's top-k and the
sparse attention it restricts (GLM-5.x, DeepSeek-V3.2).

* `indexer_topk` scores every visible position for each new token with HF's formula

      score[t, p] = sum_h weights[t, h] * relu(scale * q_idx[t, h] . key[p])

  and keeps the `topk` best. Unlike HF (`torch.topk`, arbitrary among ties) ties are
  broken by the LOWER absolute position, so the selection does not depend on how the
  positions are split into segments or the queries into blocks/chunks.
* `sparse_latent_attention` is absorbed-MLA attention (MQA, one shared key/value row
  per position) restricted to the selected positions. It gathers only the selected
  rows per query block and recomputes them in backward, so memory is
  O(query_block x K x D), never O(T x S); the state segments are read in place and
  their gradient, when wanted, is added into their `KVSegment.grad` sinks. Where each
  block's entries live is planned from bounds known on the host (`dsa_plan.BlockPlan`), so
  no call reads device data: no host sync per layer and chunk.

Index convention (both ops): indices are ABSOLUTE positions (LongTensor [T, K]);
-1 means "no position" (a query that sees fewer than K positions). Rows are ordered
by score, best first, ties by lower position; the -1 entries come last.

Legend: T new tokens at absolute positions q_start .. q_start + T - 1, S_j positions of
segment j (all before q_start), N = sum S_j + T, Hi/Di indexer heads/dim, H query heads,
D = kv_lora_rank + rope_dim key dim, Dv = kv_lora_rank value dim, K = topk.
Arithmetic is float32 for half/float32 inputs and float64 for float64 inputs.
"""

from __future__ import annotations

import torch

from longstraw.ops.attention import KVSegment, accumulation_dtype
from longstraw.ops.indexer_scores import indexer_scores_into
from longstraw.ops.ranked import ranked_topk
from longstraw.ops.sparse_latent import sparse_latent_backward, sparse_latent_forward

__all__ = ["indexer_topk", "indexer_scores", "select_topk", "select_candidates", "sparse_latent_attention",
           "SparseLatentAttention"]


# ---------------------------------------------------------------------------------------------
# indexer


def select_topk(scores: torch.Tensor, pos: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of each row of `scores` [B, n] (-inf = invisible), columns at absolute
    positions `pos` [n]. Returns [B, topk] positions, best first, ties by lower position,
    -1 where a row has fewer than topk visible columns. No read of device data
    (`ranked.ranked_topk`)."""
    bsz, n = scores.shape
    return ranked_topk(scores, pos[None].expand(bsz, n), scores > float("-inf"), topk)[0]


@torch.no_grad()
def indexer_scores(q_idx, weights, keys, *, scale, key_block=1024, out=None):
    """HF's index score of each query [T] for each key row [n]: [T, n] (accumulation
    dtype), `relu(q @ k^T * scale)` summed over heads with `weights`. q_idx [T, Hi, Di],
    weights [T, Hi], keys [n, Di]. No masking. `out`: a [T, n] tensor (or view) to write
    into instead of a new one (the registered op writes it in place)."""
    acc = accumulation_dtype(q_idx.dtype)
    if out is None:
        out = torch.empty(q_idx.shape[0], keys.shape[0], dtype=acc, device=q_idx.device)
    indexer_scores_into(q_idx, weights, keys, out, float(scale), int(key_block))  # one registered op
    return out


def select_candidates(scores: torch.Tensor, positions: torch.Tensor, topk: int, *, with_scores: bool = False):
    """Per row, the top-k of candidate (score, position) pairs [T, n] (-1 positions are
    empty slots; a row's positions are distinct): best score first, ties to the lower
    position. Returns [T, topk] positions, -1-padded (with `with_scores`, also their scores
    [T, topk], -inf padded). Used to merge per-shard candidates into the global selection.
    No read of device data (`ranked.ranked_topk`; `naive.naive_select_candidates`, its
    twin, sorts all n twice)."""
    out, kept = ranked_topk(scores, positions, (positions >= 0) & (scores > float("-inf")), topk)
    return (out, kept) if with_scores else out


@torch.no_grad()
def indexer_topk(q_idx, weights, key_segments, new_keys, q_start, topk, *, scale, query_block=128,
                 key_block=1024):
    """DSA indexer: the top-k visible positions of each new token.

    Args:
        q_idx: [T, Hi, Di] indexer queries of the new tokens (positions q_start .. q_start+T-1).
        weights: [T, Hi] per-head weights, already including HF's n_heads**-0.5 factor.
        key_segments: list of (keys [S_j, Di], start_j): indexer keys of earlier positions
            start_j .. start_j + S_j - 1, non-overlapping, all < q_start, in any order.
        new_keys: [T, Di] indexer keys of the new tokens.
        q_start: absolute position of the first new token.
        topk: number of positions to keep per query (K).
        scale: indexer softmax scale (HF: index_head_dim**-0.5), applied before the relu.
        query_block: queries scored at once; memory is O(query_block x N).
        key_block: keys per matmul; bounds the [query_block, Hi, key_block] temporary.

    Returns:
        LongTensor [T, topk] of absolute positions. Visible to query t: every segment
        position and the new positions <= q_start + t. Ordered by score, best first; equal
        scores by LOWER position (deterministic, so chunking never changes the selection).
        Where fewer than topk positions are visible the row is padded with -1 at the end.
    """
    t, hi, di = q_idx.shape
    assert weights.shape == (t, hi), (weights.shape, q_idx.shape)
    assert new_keys.shape == (t, di), (new_keys.shape, q_idx.shape)
    acc = accumulation_dtype(q_idx.dtype)
    device = q_idx.device
    segs = sorted(((k, int(s)) for k, s in key_segments if k.shape[0] > 0), key=lambda ks: ks[1])
    end = None
    for k, s in segs:
        assert k.dim() == 2 and k.shape[1] == di, (k.shape, di)
        assert end is None or s >= end, "key segments overlap"
        end = s + k.shape[0]
    assert end is None or end <= q_start, "a key segment must end before the queries"
    s_total = sum(k.shape[0] for k, _ in segs)
    # columns in increasing absolute position: the segments (sorted), then the new tokens
    pos_all = torch.cat([torch.arange(s, s + k.shape[0], device=device) for k, s in segs]
                        + [torch.arange(q_start, q_start + t, device=device)])
    out = torch.full((t, topk), -1, dtype=torch.long, device=device)
    if t == 0 or topk == 0:
        return out
    for b0 in range(0, t, query_block):
        b1 = min(t, b0 + query_block)
        bsz = b1 - b0
        n = s_total + b1  # new tokens after b1 - 1 are invisible to this whole block
        scores = torch.empty(bsz, n, dtype=acc, device=device)
        col = 0
        for keys in [k for k, _ in segs] + [new_keys[:b1]]:
            indexer_scores(q_idx[b0:b1], weights[b0:b1], keys, scale=scale, key_block=key_block,
                           out=scores[:, col:col + keys.shape[0]])
            col += keys.shape[0]
        j = torch.arange(b1, device=device)
        qi = torch.arange(b0, b1, device=device)
        scores[:, s_total:].masked_fill_(j[None, :] > qi[:, None], float("-inf"))
        out[b0:b1] = select_topk(scores, pos_all[:n], topk)
        del scores
    return out


# ---------------------------------------------------------------------------------------------
# sparse attention


class SparseLatentAttention(torch.autograd.Function):
    """out [H, T, Dv] (accumulation dtype) of MQA restricted to selected positions, with recompute.

    forward(q [H, T, D], k_new [T, D], v_new [T, Dv], indices [T, K], prefixes, q_start, scale,
    query_block). Saves q, k_new, v_new, indices, out and lse; the prefix segments are held by
    reference. Gradients go to q, k_new, v_new, and into each segment's `grad` sink (if any);
    the segments themselves are constants to autograd. Each pass is one registered op
    (`ops/sparse_latent.py`).
    """

    @staticmethod
    def forward(ctx, q, k_new, v_new, indices, prefixes, q_start, scale, query_block):
        acc = accumulation_dtype(q.dtype)
        h, t, _ = q.shape
        segs = [seg for seg in prefixes if seg.k.shape[1] > 0]
        out = torch.zeros(h, t, v_new.shape[1], dtype=acc, device=q.device)
        lse = torch.full((h, t), float("-inf"), dtype=acc, device=q.device)
        sparse_latent_forward(q, k_new, v_new, indices, [seg.k[0] for seg in segs], [seg.v[0] for seg in segs],
                              [int(seg.start) for seg in segs], int(q_start), float(scale), int(query_block), out, lse)
        ctx.save_for_backward(q, k_new, v_new, indices, out, lse)
        ctx.segs = segs
        ctx.q_start, ctx.scale, ctx.query_block = q_start, scale, query_block
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse=None):
        q, k_new, v_new, indices, out, lse = ctx.saved_tensors
        acc, segs = out.dtype, ctx.segs
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(acc)
        delta = (grad_out * out).sum(dim=-1)  # [H, T]
        if grad_lse is not None:  # d lse / d score = softmax: enters like a shift of delta
            delta = delta - grad_lse.to(acc)
        # +inf where a row had no index, so exp(s - lse) is 0 there, never NaN.
        lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
        need_dk, need_dv = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk_new = torch.zeros(k_new.shape, dtype=acc, device=q.device) if need_dk else None
        dv_new = torch.zeros(v_new.shape, dtype=acc, device=q.device) if need_dv else None
        none = q.new_empty(0)
        sink_k = [none if seg.grad is None else seg.grad[0][0] for seg in segs]
        sink_v = [none if seg.grad is None else seg.grad[1][0] for seg in segs]
        sparse_latent_backward(q, k_new, v_new, indices, lse, grad_out, delta,
                               [seg.k[0] for seg in segs], [seg.v[0] for seg in segs],
                               [int(seg.start) for seg in segs], sink_k, sink_v, int(ctx.q_start), float(ctx.scale),
                               int(ctx.query_block), dq, dk_new, dv_new)
        return (dq.to(q.dtype), None if dk_new is None else dk_new.to(k_new.dtype),
                None if dv_new is None else dv_new.to(v_new.dtype), None, None, None, None, None)


def sparse_latent_attention(q, k_new, v_new, indices, *, prefixes: list[KVSegment], q_start: int, scale: float,
                            query_block: int = 64, return_lse: bool = False):
    """Absorbed-MLA attention of T new tokens restricted to the DSA-selected positions.

    Args:
        q: [H, T, D] queries (absorbed into latent space) at positions q_start .. q_start + T - 1.
        k_new, v_new: [T, D] / [T, Dv] the new tokens' shared key/value rows (v_new may be a view
            of k_new[:, :Dv]).
        indices: LongTensor [T, K] absolute positions to attend to, -1 = none (e.g. from
            `indexer_topk`); each must lie in exactly one prefix segment or be a new position at
            or before its query's own (visible); order is irrelevant; no duplicates other than
            -1. Checked on the device (`dsa_plan.check_indices`: RuntimeError on CPU).
        prefixes: `KVSegment`s with k [1, S, D], v [1, S, Dv] (v may be a view of k[..., :Dv]),
            all before q_start; optional grad = (dk [1, S, D], dv [1, S, Dv]) sinks, added into
            in place by backward (dv may be a view into dk's first Dv columns).
        scale: softmax scale. query_block: queries per gathered block; memory O(query_block x K x D).

    Returns:
        [H, T, Dv] in q's dtype. A row whose indices are all -1 gets zeros (and no gradient).
        With `return_lse`, also the log-sum-exp [H, T] (accumulation dtype; -inf for such a
        row), differentiable, for merging with attention over other positions.
    """
    h, t, d = q.shape
    assert k_new.shape == (t, d), (k_new.shape, q.shape)
    assert v_new.dim() == 2 and v_new.shape[0] == t, (v_new.shape, q.shape)
    assert indices.dim() == 2 and indices.shape[0] == t, (indices.shape, q.shape)
    for seg in prefixes:
        assert seg.k.dim() == 3 and seg.k.shape[0] == 1 and seg.k.shape[2] == d, (seg.k.shape, d)
        assert seg.v.shape == (1, seg.k.shape[1], v_new.shape[1]), (seg.v.shape, v_new.shape)
        assert seg.start + seg.k.shape[1] <= q_start, "a prefix segment must end before the queries"
        assert getattr(seg, "cp", None) is None, "split a sharded segment off first (see models/mla.py)"
    out, lse = SparseLatentAttention.apply(q, k_new, v_new, indices.long(), list(prefixes), q_start, scale,
                                           query_block)
    return (out, lse) if return_lse else out.to(q.dtype)
