"""Batched decode for MLA (+ DSA) layers: G branches, one token each, over one shared
prompt state of latent rows (GLM-5.x, DeepSeek-V3.2, DeepSeek-V3).

`mla.py` computes the new tokens' absorbed queries, latent rows and indexer inputs with
the model's own modules (treating the G branch tokens as a sequence of G) and hands them
here. Attention stays absorbed over the latent rows:

* dense selection (every query sees at most top-k positions, or no DSA): MQA over the
  shared prompt rows plus each branch's own rows (`ops/decode_attention.decode_attention`);
* DSA: each branch query scores the prompt's indexer keys and its own, keeps the top-k
  with the same rule as replay (best score first, ties to the lower position; globally
  over the whole prompt, across ranks under context parallelism), and attends over the
  selected rows only, gathered per branch.

Legend: G branches, H heads, D = R + Dr latent + rope width, R = kv_lora_rank, K top-k,
Hi / Di indexer heads / dim, n own tokens.
"""

from __future__ import annotations

import torch

from longstraw.ops.decode_attention import decode_attention, gathered_partial
from longstraw.ops.dsa import indexer_scores, select_candidates
from longstraw.ops.ranked import ranked_topk
from longstraw.ops.flash import merge_partials
from longstraw.parallel.topk import shard_topk
from longstraw.state.branch import BranchLatent
from longstraw.state.prompt import MLAState

from .attention import merge_shard

def prompt_candidates(index_q, weights, prompt_index, until: int, topk: int, scale: float):
    """Each query's top-k among the prompt's indexer keys before `until`: (positions [B, K'],
    scores [B, K']), -1 / -inf padded, for queries index_q [B, Hi, Di] (float32) with
    weights [B, Hi]. Context-parallel: the global top-k of every rank's shard candidates
    (every member of it is in its own shard's top-k), agreed by `parallel.topk.shard_topk`
    in bytes per query flat in W. Decode and replay's selection across ranks
    (`mla._select_across_ranks`) both use it."""
    keys, pos = prompt_index.until(until), prompt_index.positions(until)
    scores = indexer_scores(index_q, weights, keys, scale=scale)  # (G, S) float32
    cand, cand_sc = ranked_topk(scores, pos[None].expand(scores.shape), scores > float("-inf"), topk)  # (G, K) each
    if prompt_index.shard is not None:  # (a prompt of < 2^31 positions)
        cand, cand_sc = shard_topk(cand, cand_sc, topk, prompt_index.shard.cp)
    return cand, cand_sc


@torch.no_grad()
def decode_topk(index_q, weights, prompt_index, own_keys, own_start: int, topk: int, scale: float,
                own_lengths: torch.Tensor | None = None):
    """DSA selection for G branch queries, branch b's at position own_start + own_lengths[b] - 1.

    Args:
        index_q: [G, Hi, Di] indexer queries; weights: [G, Hi] (HF's n_heads**-0.5 included).
        prompt_index: the prompt's `IndexKeys` (shared by every branch).
        own_keys: [G, n, Di] each branch's own indexer keys, the current token's at row
            own_lengths[b] - 1 (None: every branch holds n, the current token's last).
    Returns:
        LongTensor [G, topk] absolute positions, best first, ties to the lower position, -1 padded.
    """
    q = index_q.float()  # scored in float32, as HF (and replay) do
    cand, cand_sc = prompt_candidates(q, weights, prompt_index, own_start, topk, scale)
    own = torch.relu(torch.einsum("ghd,gnd->ghn", q, own_keys.float()) * scale)
    own_sc = torch.einsum("gh,ghn->gn", weights.float(), own)  # (G, n)
    own_pos = torch.arange(own_start, own_start + own_keys.shape[1], device=q.device).expand(q.shape[0], -1)
    if own_lengths is not None:  # rows past a branch's own length are empty slots (-1)
        own_pos = torch.where(own_pos < own_start + own_lengths[:, None], own_pos, -1)
    return select_candidates(torch.cat([cand_sc, own_sc], dim=1), torch.cat([cand, own_pos], dim=1), topk)


def _sparse_decode(q, own: BranchLatent, prompt: MLAState, indices, scale: float, rank: int, rows=None,
                   lengths=None):
    """Absorbed attention of q [G, H, D] over the selected rows (indices [G, K]) of the
    prompt's latent (gathered per branch; merged across ranks when sharded) and of each
    branch's own rows (lengths [G] of them filled). Returns [G, H, R]."""
    kv = prompt.latent
    seg = kv.segment(until=own.start)
    rows_k = seg.k[0]  # (S_local, D)
    in_prompt = (indices >= kv.start) & (indices < own.start)
    safe = indices.clamp(min=0)
    if kv.shard is None:
        local, valid = safe - kv.start, in_prompt
    else:
        local, valid = kv.shard.count(safe) - kv.shard.count(kv.start), in_prompt & kv.shard.owns(safe)
    valid = valid & (local < rows_k.shape[0])
    k_sel = rows_k[local.clamp(0, max(rows_k.shape[0] - 1, 0))] if rows_k.shape[0] else q.new_zeros(
        *indices.shape, rows_k.shape[1])  # (G, K, D): the selected prompt rows, per branch
    out, lse = gathered_partial(q, k_sel, k_sel[..., :rank], valid, scale)
    if kv.shard is not None:
        out, lse = merge_shard(out, lse, seg)
    own_rows = own.filled(rows)  # (G, n, D)
    own_pos = torch.arange(own.start, own.start + own_rows.shape[1], device=q.device)
    if lengths is not None:  # rows past a branch's length are uninitialised: never selected, and zeroed (0 * NaN)
        own_rows = own_rows.masked_fill((own_pos[None] >= own.start + lengths[:, None])[..., None], 0)
    chosen = (indices[:, :, None] == own_pos[None, None, :]).any(1)  # (G, n)
    out_b, lse_b = gathered_partial(q, own_rows, own_rows[..., :rank], chosen, scale)
    return merge_partials(out, lse, out_b, lse_b)


def mla_decode(q, k_new, own: BranchLatent, prompt: MLAState, *, position: int, scale: float, rank: int,
               block_size: int, topk: int | None, index_inputs=None, index_topk_scale: float | None = None,
               prev_indices=None, rows=None):
    """One decode step of an MLA layer for G branches.

    Args:
        q: [G, H, D] absorbed queries; k_new: [G, D] the new latent rows (latent | rope key).
        own: the branches' own rows of this layer (the new rows are appended here).
        prompt: the prompt's `MLAState` of this layer (read only).
        position: absolute position of the new tokens (an int, or LongTensor [G] each
            branch's own). rank: kv_lora_rank R.
        topk: the layer's DSA top-k (None: no DSA). index_inputs: (index_q [G, Hi, Di],
            new index keys [G, Di], weights [G, Hi]) for a layer with its own indexer.
        prev_indices: the previous layer's selection [G, K] (GLM-5 "shared" layers).
        rows: the branches being decoded (None: all G; G then reads B = len(rows)).
    Returns:
        (o_lat [G, H, R] in q's dtype, indices [G, K] or None).
    """
    own.append(k_new, None if index_inputs is None else index_inputs[1], rows)
    lengths = torch.tensor(own.lengths_of(rows), device=q.device)  # (G,)
    indices = None
    last = int(position.max()) if isinstance(position, torch.Tensor) else position
    if topk is not None and topk < last + 1:  # a query sees more than top-k positions (one that sees
        # fewer selects every position it sees: the dense attention, gathered)
        if index_inputs is not None:
            index_q, _, weights = index_inputs
            indices = decode_topk(index_q, weights, prompt.index, own.filled_index_keys(rows), own.start, topk,
                                  index_topk_scale, lengths)
        else:
            indices = prev_indices
            assert indices is not None, "a shared DSA layer needs the previous layer's selection"
        return _sparse_decode(q, own, prompt, indices, scale, rank, rows, lengths).to(q.dtype), indices
    own_k = own.filled(rows)[:, None]  # (G, 1, n, D): one (MQA) kv head
    out = decode_attention(q, own_k, own_k[..., :rank], own_start=own.start,
                           prefixes=[prompt.latent.segment(until=own.start)], q_position=position, scale=scale,
                           block_size=block_size, reduce_shard=merge_shard, own_lengths=lengths)
    return out, indices
