"""The divided indexer's work on one fetched piece of keys, as one registered op:
`longstraw::indexer_piece_topk`.

`divided_dsa.divided_indexer_topk` fetches every rank's indexer keys piece by piece and,
per piece, merges each block of this rank's queries' scores over the piece into their
running top-k. That is a loop over (piece, query block): about P² / (piece x query block)
iterations a layer, each a dozen ops (the scores, the causal mask, two concatenations and a
top-k), so at the paper's P = 2.1M on 32 ranks a rehearsal would dispatch millions of fake
ops in the indexer alone. As one op it is one call per piece to anything that watches ops:
its temporaries are declared as its workspace (`ops/workspace.py`: an upper bound of the
loop's measured peak, tests/parallel/test_indexer_pieces.py) and its matmuls as its FLOP
formula. The real implementation is the plain loop (`merge_piece`).

    longstraw::indexer_piece_topk(q_idx, weights, keys, q_pos, k_pos, blocks[], scale,
                                  key_block, best(a!), best_sc(a!)) -> ()

Shapes: q_idx [N, Hi, Di], weights [N, Hi] (this rank's queries, HF's n_heads**-0.5 in the
weights), keys [n, Di] and k_pos [n] (the piece's rows and their absolute positions,
increasing), q_pos [N] (the queries' positions); blocks: (b0, b1, seen) per query block,
flat (the host's plan: queries b0..b1-1 see the piece's first `seen` rows at most); best
[N, K] int64 and best_sc [N, K] (accumulation dtype): the running selection, replaced per
block by the top-k of it and the block's visible scores (`dsa.select_candidates`).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.ops.dsa import select_candidates
from longstraw.ops.indexer_scores import score_blocks, scoring_bytes
from longstraw.ops.ranked import selection_bytes
from longstraw.ops.workspace import declare_workspace

Tensor = torch.Tensor

def merge_piece(q_idx, weights, keys, q_pos, k_pos, blocks, scale: float, key_block: int, best, best_sc) -> None:
    """The plain loop (the op's implementation): per planned query block, score the piece's
    first `seen` rows, mask the ones after each query, and keep the top-k of the running
    selection and these."""
    topk = best.shape[1]
    for b0, b1, seen in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
        visible = k_pos[None, :seen] <= q_pos[b0:b1, None]  # (B, seen)
        sc = torch.empty(b1 - b0, seen, dtype=best_sc.dtype, device=best_sc.device)
        score_blocks(q_idx[b0:b1], weights[b0:b1], keys[:seen], sc, scale, key_block)
        sc.masked_fill_(~visible, float("-inf"))
        cand_pos = torch.cat([best[b0:b1], torch.where(visible, k_pos[None, :seen], -1)], dim=1)
        best[b0:b1], best_sc[b0:b1] = select_candidates(torch.cat([best_sc[b0:b1], sc], dim=1), cand_pos, topk,
                                                        with_scores=True)
        del visible, sc, cand_pos


@torch.library.custom_op("longstraw::indexer_piece_topk", mutates_args=("best", "best_sc"))
def indexer_piece_topk(q_idx: Tensor, weights: Tensor, keys: Tensor, q_pos: Tensor, k_pos: Tensor, blocks: list[int],
                       scale: float, key_block: int, best: Tensor, best_sc: Tensor) -> None:
    merge_piece(q_idx, weights, keys, q_pos, k_pos, blocks, scale, key_block, best, best_sc)


@indexer_piece_topk.register_fake
def _(q_idx, weights, keys, q_pos, k_pos, blocks, scale, key_block, best, best_sc):
    return None


def workspace_bytes(q_idx, weights, keys, q_pos, k_pos, blocks, scale, key_block, best, best_sc) -> int:
    """The most bytes `merge_piece` holds at once, over its blocks of B queries seeing s rows
    (m = K + s candidates): the visible mask [B, s] and the scores [B, s] beside either the
    scoring's own workspace, or the candidates' positions (their [B, s] part, then the
    [B, m] concatenation), or the [B, m] candidates (positions and scores) with
    `select_candidates`' valid mask and its registered selection's declared workspace
    (`ops/ranked.selection_bytes`)."""
    topk, acc = best.shape[1], best_sc.element_size()
    _, hi, di = q_idx.shape
    dtypes = [q_idx.dtype, weights.dtype, keys.dtype]
    peak = 0
    for b0, b1, seen in zip(blocks[0::3], blocks[1::3], blocks[2::3]):
        b, m = b1 - b0, topk + seen
        held = b * seen * (1 + acc)
        scoring = scoring_bytes(b, hi, di, seen, key_block, dtypes, best_sc.dtype) + b * seen
        candidates = 8 * b * (seen + m)
        select = b * m * (8 + acc + 1) + selection_bytes(b, m, topk, acc == 8)  # the candidates, their valid mask
        peak = max(peak, held + max(scoring, candidates, select))
    return peak


declare_workspace(torch.ops.longstraw.indexer_piece_topk.default, workspace_bytes)


@register_flop_formula(torch.ops.longstraw.indexer_piece_topk)
def _flops(q_shape, weights_shape, keys_shape, q_pos_shape, k_pos_shape, blocks, *args, **kwargs) -> int:
    """The scoring's matmuls, 2 B Hi s (Di + 1) a block (`indexer_scores`'), as the counter
    counts the loop unregistered (the selection has none)."""
    _, hi, di = q_shape
    return sum(2 * (b1 - b0) * hi * seen * (di + 1) for b0, b1, seen in zip(blocks[0::3], blocks[1::3], blocks[2::3]))
