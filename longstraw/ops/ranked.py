"""The k best entries of each row by (score descending, position ascending), without a
read of device data.

DSA's selection (`dsa.select_topk`, `dsa.select_candidates`) orders a row's entries by
score, best first, and breaks equal scores by the lower absolute position, so the result
does not depend on how the positions are split into segments, shards or blocks. The
order is total, since a row's positions are distinct.

* float32 scores (the indexer scores in float32, as HF does): each entry's order key is one
  int64, the score's order key (`order_key`, 32 bits) above the position's complement
  (31 bits). One `topk` over the keys is the selection in its final order: no ties, no
  sort, and no output whose size depends on the data (a `nonzero` or a `.item()` would
  make a GPU wait for the device, and cannot run on a rehearsal's fake tensors).
* float64 scores (CPU references): the k-th best score is the threshold; every entry above
  it is in, and of those equal to it the lowest positions (a second `topk`) fill the rest;
  the chosen are then sorted by position and, stably, by score.

Legend: B rows, n entries a row, k kept. Positions are below 2^31; -1 marks an empty slot.
"""

from __future__ import annotations

import torch

from longstraw.ops.workspace import declare_workspace

__all__ = ["order_key", "ranked_topk"]

POSITION_KEY_BITS = 31
_LONG_MAX = torch.iinfo(torch.long).max
_LONG_MIN = torch.iinfo(torch.long).min


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys of scores (float32 or float64, no NaN) in the same order, equal scores
    equal keys: the IEEE bits with negative values' magnitude bits flipped. -0.0 is taken as
    +0.0 first (they compare equal; DSA's relu gives either sign of zero)."""
    scores = scores + 0.0  # -0.0 + 0.0 = +0.0
    if scores.dtype == torch.float64:
        bits = scores.contiguous().view(torch.int64)
        return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)
    bits = scores.float().contiguous().view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()


def ranked_topk(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, k: int):
    """The k best valid entries of each row: (positions [B, k] -1 padded, scores [B, k]
    -inf padded), best score first, equal scores by the lower position.

    scores [B, n] (float32 or float64; finite where valid), positions [B, n] (int64,
    distinct within a row where valid, in [0, 2^31)), valid [B, n] bool. No read of device
    data; O(B n) plus a top-k (float32) or three (float64). One registered op,
    `longstraw::ranked_topk` (`rank_entries` inside): a selection is one op, not two dozen,
    to a rehearsal and the live-byte tracker (its temporaries declared: `workspace_bytes`)."""
    return tuple(RANKED_TOPK(scores, positions, valid, int(k)))


def rank_entries(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, k: int):
    """`ranked_topk`'s plain implementation."""
    bsz, n = scores.shape
    kt = min(k, n)
    if kt == 0:
        return positions.new_full((bsz, k), -1), scores.new_full((bsz, k), float("-inf"))
    if scores.dtype == torch.float64:
        cols, chosen = _chosen_by_threshold(scores, positions, valid, kt)
    else:
        key = (order_key(scores) << POSITION_KEY_BITS) | ((1 << POSITION_KEY_BITS) - 1 - positions.clamp(min=0))
        key = torch.where(valid, key, _LONG_MIN)
        cols = key.topk(kt, dim=-1).indices  # sorted, keys distinct: the final order
        chosen = valid.gather(-1, cols)
    out_pos = torch.where(chosen, positions.gather(-1, cols), -1)
    out_sc = torch.where(chosen, scores.gather(-1, cols), float("-inf"))
    if kt < k:
        out_pos = torch.cat([out_pos, out_pos.new_full((bsz, k - kt), -1)], dim=1)
        out_sc = torch.cat([out_sc, out_sc.new_full((bsz, k - kt), float("-inf"))], dim=1)
    return out_pos, out_sc


def _chosen_by_threshold(scores, positions, valid, kt: int):
    """float64: (cols [B, kt] in the final order, chosen [B, kt]): the threshold selection."""
    masked = torch.where(valid, scores, float("-inf"))
    thr = masked.topk(kt, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # the kt-th best, [B, 1]
    above = valid & (masked > thr)  # thr = -inf: fewer than kt valid, all of them are in
    tied = valid & (masked == thr) & torch.isfinite(thr)
    need = kt - above.sum(dim=-1, keepdim=True)  # [B, 1]: how many of the tied go in
    tied_pos = torch.where(tied, positions, _LONG_MAX)
    lowest = tied_pos.topk(kt, dim=-1, largest=False).values  # [B, kt], ascending
    cut = lowest.gather(-1, (need - 1).clamp(min=0))  # the need-th lowest tied position
    chosen = above | (tied & (positions <= cut) & (need > 0))
    cols = torch.where(chosen, masked, float("-inf")).topk(kt, dim=-1).indices  # the chosen, any order
    picked = chosen.gather(-1, cols)
    by_pos = torch.where(picked, positions.gather(-1, cols), _LONG_MAX).sort(dim=-1, stable=True).indices
    cols, picked = cols.gather(-1, by_pos), picked.gather(-1, by_pos)
    by_score = torch.where(picked, masked.gather(-1, cols), float("-inf")).sort(dim=-1, descending=True,
                                                                                stable=True).indices
    return cols.gather(-1, by_score), picked.gather(-1, by_score)


@torch.library.custom_op("longstraw::ranked_topk", mutates_args=())
def _ranked_topk_op(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    out_pos, out_sc = rank_entries(scores, positions, valid, k)
    return out_pos.contiguous(), out_sc.contiguous()


@_ranked_topk_op.register_fake
def _(scores, positions, valid, k):
    return positions.new_empty(scores.shape[0], k), scores.new_empty(scores.shape[0], k)


def workspace_bytes(scores, positions, valid, k) -> int:
    """The most bytes `rank_entries` holds at once, its [B, k] outputs included (a bound,
    measured under the tracker in tests/ops/test_ranked.py). float32: the order keys, three
    int64 and a float32 copy a candidate (24 B), beside the top-k's [B, kt] values and
    indices; float64: the threshold selection's masks and int64 copies (28 B a candidate)
    beside its top-ks' and sorts' [B, kt] outputs. Plus the -1 padding where k > n."""
    return selection_bytes(*scores.shape, k, scores.dtype == torch.float64)


def selection_bytes(b: int, n: int, k: int, float64: bool) -> int:
    """`workspace_bytes` of a [b, n] selection of k (float64 scores or not), from shapes."""
    kt = min(k, n)
    per, kept = (28, 42) if float64 else (24, 12)
    return b * (per * n + kept * kt + 24 * (k - kt))


RANKED_TOPK = torch.ops.longstraw.ranked_topk.default
declare_workspace(RANKED_TOPK, workspace_bytes)
