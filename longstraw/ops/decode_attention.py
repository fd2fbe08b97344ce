"""Batched decode attention: G branches, one new token each, over one shared prompt state.

In a rollout the G branches decode together, one call per step, each at its own
absolute position (they drift apart when an agent episode absorbs an observation into
one branch): branch b's query sits at q_position[b] and its own cache holds
own_lengths[b] rows, the rest of the [G, Hkv, n, D] block masked. Each query attends to
two disjoint key sets, merged by log-sum-exp exactly as in replay (`ops/attention.py`):

* the shared prompt state (read in place, never copied, expanded per branch or
  concatenated): the G x g query heads of one kv head fold into the rows of ONE
  attention over the prompt's K/V, so the prompt is read once per step for all G;
* the branch's own generated tokens (a small [G, Hkv, n, D] cache, n <= max_new_tokens),
  one plain batched softmax per branch.

The same op serves absorbed MLA, which is MQA over the latent rows (Hkv = 1, g = H,
D = kv_lora_rank + rope_dim, the value a view of the first kv_lora_rank columns), and
DSA, whose top-k rows are gathered per branch (`gathered_partial`).

Legend: G branches, H query heads, Hkv kv heads, g = H / Hkv, n own tokens, S prompt
positions, D key dim, Dv value dim, K selected positions. No autograd: a rollout runs
under no_grad. Arithmetic in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from ..tensors import accumulation_dtype
from .attention import PrefixAttention
from .flash import empty_partial, fused_kernel, fused_takes, merge_partials, merge_sink


def shared_partial(rows, seg_k, seg_v, seg_start: int, q_position, scale: float, window: int | None,
                   block_size: int):
    """(o [Hkv, M, Dv], lse [Hkv, M]) of query rows [Hkv, M, D] at `q_position` (an int,
    or a LongTensor [M] per row) over one shared segment k [Hkv, S, D], v [Hkv, S, Dv] at
    positions seg_start.. (an int; or LongTensor [S], every row's position: a sharded
    window's rows) (no grad). Uses torch's fused flash kernel where it applies
    (no window: the segment lies wholly before every query), else the blockwise kernel."""
    hkv, m, _ = rows.shape
    if seg_k.shape[1] == 0:  # e.g. an empty shard on this rank
        return empty_partial(rows, hkv, m, seg_v.shape[-1])
    if fused_takes(rows, seg_v.shape[-1], window):
        flash = fused_kernel(rows.device.type, rows.dtype)
        out, lse = flash(rows[None], seg_k[None], seg_v[None], False, scale)  # (1, Hkv, M, Dv), (1, Hkv, M)
        return out[0].to(lse.dtype), lse[0]
    q_pos = torch.as_tensor(q_position, dtype=torch.long, device=rows.device).expand(m).contiguous()
    return PrefixAttention.apply(rows, seg_k, seg_v, q_pos, seg_start, scale, window, block_size, None, False)


def own_partial(q, own_k, own_v, own_start: int, q_position, scale: float, window: int | None,
                own_lengths: torch.Tensor | None = None):
    """(o [G, Hkv, g, Dv], lse [G, Hkv, g]) of q [G, Hkv, g, D] over each branch's own keys
    own_k [G, Hkv, n, D] / own_v [G, Hkv, n, Dv] at positions own_start .. . Branch b holds
    own_lengths[b] rows (None: all n), the last at its query's position q_position (an int,
    or LongTensor [G])."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("bhgd,bhnd->bhgn", q.to(acc), own_k.to(acc)) * scale  # (G, Hkv, g, n)
    pos = torch.arange(own_start, own_start + own_k.shape[2], device=q.device)  # (n,)
    if own_lengths is not None:  # a shorter branch's rows past its own length are not its tokens (nor read:
        # they are uninitialised memory, and 0 * NaN is NaN)
        empty = pos[None] >= own_start + own_lengths.to(q.device)[:, None]  # (G, n)
        scores = scores.masked_fill(empty[:, None, None], float("-inf"))
        own_v = own_v.masked_fill(empty[:, None, :, None], 0)
    if window is not None:
        qp = torch.as_tensor(q_position, device=q.device).reshape(-1, 1)  # (G or 1, 1)
        scores = scores.masked_fill((qp - pos[None] >= window)[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (G, Hkv, g); finite: the query's own token is always visible
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("bhgn,bhnv->bhgv", probs, own_v.to(acc)), lse


def decode_attention(q, own_k, own_v, *, own_start: int, prefixes, q_position, scale: float,
                     window: int | None = None, block_size: int = 1024, reduce_shard=None, own_lengths=None,
                     sinks=None):
    """Attention of G branch queries, each at its own position, over shared prefixes plus
    their own tokens.

    Args:
        q: [G, H, D] queries (after RoPE) at absolute positions `q_position` (an int: all
            at one position, or a LongTensor [G]).
        own_k, own_v: [G, Hkv, n, D] / [G, Hkv, n, Dv] each branch's own tokens at positions
            own_start .. own_start + n - 1, the current token included (own_v may be a view
            of own_k's first Dv columns).
        own_lengths: LongTensor [G], the rows branch b holds (its current token at row
            own_lengths[b] - 1 = q_position[b] - own_start); None: all n.
        prefixes: `KVSegment`s shared by every branch (k [Hkv, S, D], v [Hkv, S, Dv]), all
            before own_start. A segment with `cp` set is this rank's shard of a
            context-parallel state: its partial (o, lse) is passed through
            `reduce_shard(o, lse, segment)`, which must merge it across ranks.
        scale: softmax scale. window: sliding window or None. block_size: prompt block.
        sinks: [H] sink logits joining each softmax denominator once (`flash.merge_sink`), or None.

    Returns:
        [G, H, Dv] in q's dtype.
    """
    b, h, d = q.shape
    hkv, dv = own_k.shape[1], own_v.shape[-1]
    g = h // hkv
    assert h == g * hkv and own_k.shape[0] == b and own_k.shape[3] == d, (q.shape, own_k.shape)
    q4 = q.view(b, hkv, g, d)
    out, lse = own_partial(q4, own_k, own_v, own_start, q_position, scale, window, own_lengths)
    # row layout [Hkv, G*g, .]: the G branches' query heads of one kv head are rows of one attention
    rows = q4.permute(1, 0, 2, 3).reshape(hkv, b * g, d)
    out = out.permute(1, 0, 2, 3).reshape(hkv, b * g, dv)
    lse = lse.permute(1, 0, 2).reshape(hkv, b * g)
    if isinstance(q_position, torch.Tensor):  # the rows' positions, branch-major as the rows
        q_position = q_position.to(q.device).repeat_interleave(g)  # (G*g,)
    for seg in prefixes:
        assert seg.start + seg.k.shape[1] <= own_start or seg.cp is not None, "a prefix must end before the branch"
        if seg.k.shape[1] == 0 and seg.cp is None:
            continue
        out_p, lse_p = shared_partial(rows, seg.k, seg.v, seg.key_start, q_position, scale, window, block_size)
        if seg.cp is not None:
            out_p, lse_p = reduce_shard(out_p, lse_p, seg)
        out, lse = merge_partials(out_p, lse_p, out, lse), torch.logaddexp(lse_p, lse)
    out = out.reshape(hkv, b, g, dv).permute(1, 0, 2, 3).reshape(b, h, dv)
    if sinks is not None:
        out = merge_sink(out, lse.reshape(hkv, b, g).permute(1, 0, 2).reshape(b, h), sinks[None])
    return out.to(q.dtype)


def gathered_partial(q, k_rows, v_rows, valid, scale: float):
    """(o [G, H, Dv], lse [G, H]) of q [G, H, D] over per-branch gathered rows k_rows [G, K, D],
    v_rows [G, K, Dv], where valid [G, K] (bool) marks real entries; a branch with no valid
    entry gets o = 0, lse = -inf. (DSA: the selected rows of one key source.)"""
    acc = accumulation_dtype(q.dtype)
    scores = torch.einsum("bhd,bkd->bhk", q.to(acc), k_rows.to(acc)) * scale  # (G, H, K)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (G, H)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe[..., None])  # 0 where masked
    return torch.einsum("bhk,bkv->bhv", probs, v_rows.to(acc)), lse
