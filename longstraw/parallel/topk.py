"""A global top-k across context ranks whose bytes per query do not grow with W (issue 46).

Each rank holds, per query, its own candidates (positions and scores, e.g. the top-k of its
shard of the prompt's indexer keys). The global top-k is the same selection one process's
`dsa.select_candidates` makes over all of them: best score first, ties to the lower position.

The naive twin all-gathers every rank's candidates: (W - 1) K (4 + 4) bytes per query.
Here the ranks first agree on the k-th best candidate by a radix select: every candidate's
order key is the pair (score, -position) mapped to two integers whose order is the pair's;
each round all-reduces a 16-bin histogram of one 4-bit digit of the candidates still tied
with the cut on the digits above (16 rounds for float32 scores, 24 for float64). Every
candidate at or above the cut is in (the keys are distinct: a row's positions are), so
exactly min(K, candidates) of them, and the ranks place theirs in one [B, K] buffer each
(at offsets from an all-gather of their counts) that one all-reduce sums. Bytes a rank
receives per query, with the ring model of `collectives.Traffic`:

    2 (W-1)/W (rounds 16 * 4 + K (4 + s))  +  (W - 1) 4

(s the score's bytes; `plan.traffic.radix_topk_bytes_per_query`): flat in W but for the
counts' 4 bytes a rank. At W = 2 the all-gather's K (4 + s) is less, and `shard_topk`
takes it there.
"""

from __future__ import annotations

import torch

from longstraw.ops.dsa import select_candidates
from longstraw.ops.ranked import order_key, ranked_topk
from longstraw.parallel.collectives import all_gather, all_reduce_sum
from longstraw.parallel.radix_rounds import DIGIT_BITS, radix_histogram, radix_narrow
from longstraw.plan.traffic import gathered_topk_bytes_per_query, radix_topk_bytes_per_query

POSITION_BITS = 32  # positions below 2^31, keyed as 2^31 - 1 - position (non-negative)


def score_bits(dtype: torch.dtype) -> int:
    """The width of a score's order key: 32 for float32 (and narrower floats, scored in it), 64 for float64."""
    return 64 if dtype == torch.float64 else 32


def rounds(dtype: torch.dtype) -> int:
    """Histogram all-reduces a selection takes for scores of `dtype`."""
    return (score_bits(dtype) + POSITION_BITS) // DIGIT_BITS


def _radix_cut(words: list[tuple[torch.Tensor, int]], valid: torch.Tensor, need: torch.Tensor, cp):
    """The need-th largest (lexicographic) key per row among `valid` entries over all ranks.

    words: (int64 [B, n], bits) most significant first, each fitting a signed `bits`-bit
    integer. need: [B] (>= 1 where used). Returns the cut's words, [B] each."""
    match = valid.clone()
    need = need.clone()
    cut = []
    for word, bits in words:
        value = torch.zeros_like(need)
        for shift in range(bits - DIGIT_BITS, -1, -DIGIT_BITS):
            sign = shift == bits - DIGIT_BITS
            hist = all_reduce_sum(radix_histogram(word, match, shift, sign), cp)  # [B, 16] over all ranks
            radix_narrow(hist, word, match, need, value, shift, sign)  # the bin holding the need-th
        cut.append(value)
    return cut


def global_topk(positions: torch.Tensor, scores: torch.Tensor, topk: int, cp):
    """The top-k per row of every rank's candidates (positions [B, n], -1 = empty slot;
    scores [B, n] float32/float64; a row's positions distinct across all ranks and below
    2^31): ([B, topk] positions, [B, topk] scores), best score first, ties to the lower
    position, -1 / -inf padded: what `dsa.select_candidates` gives over every rank's
    candidates concatenated. Every rank must call it with the same B and dtype."""
    b = positions.shape[0]
    device = scores.device
    valid = (positions >= 0) & (scores > float("-inf"))
    total = all_reduce_sum(valid.sum(1, dtype=torch.int32), cp).long()  # [B]
    need = total.clamp(max=topk)
    score_key = order_key(scores)
    pos_key = (2**31 - 1) - positions.clamp(min=0)  # larger = lower position
    cut_score, cut_pos = _radix_cut([(score_key, score_bits(scores.dtype)), (pos_key, POSITION_BITS)], valid,
                                    need.clamp(min=1), cp)
    above = (score_key > cut_score[:, None]) | ((score_key == cut_score[:, None]) & (pos_key >= cut_pos[:, None]))
    chosen = valid & above & (need[:, None] > 0)
    count = chosen.sum(1, dtype=torch.int32)  # [B], this rank's share of the selection
    counts = torch.stack(all_gather(count, cp))  # [W, B]
    offset = (counts.cumsum(0) - counts)[cp.rank].long()  # ranks before this one
    # each chosen entry's slot: the ranks' shares before this one, then its place among this rank's
    # chosen in the row; the others go to a spare last column, dropped (no `nonzero`: no read of device data)
    slot = torch.where(chosen, offset[:, None] + chosen.cumsum(1) - 1, topk)
    pos_buf = torch.zeros(b, topk + 1, dtype=torch.int32, device=device)
    sc_buf = torch.zeros(b, topk + 1, dtype=scores.dtype, device=device)
    pos_buf.scatter_(1, slot, (positions + 1).to(torch.int32))  # 0 = empty after the sum
    sc_buf.scatter_(1, slot, scores)
    pos_buf, sc_buf = pos_buf[:, :topk], sc_buf[:, :topk]
    packed = torch.cat([pos_buf.view(torch.uint8).reshape(b, -1), sc_buf.view(torch.uint8).reshape(b, -1)], 1)
    packed = all_reduce_sum(_as_words(packed), cp)  # one collective; a slot has one rank's bytes, others 0
    raw = packed.view(torch.uint8).reshape(b, -1)
    out_pos = raw[:, : 4 * topk].contiguous().view(torch.int32).long() - 1
    out_sc = raw[:, 4 * topk :].contiguous().view(scores.dtype)
    # order: score descending, equal scores by lower position, empty slots last
    return ranked_topk(out_sc, out_pos, out_pos >= 0, topk)


def _as_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [B, m] (m a multiple of 4) as int32 [B, m / 4]: summed word by word, a word
    that only one rank fills comes back bit for bit."""
    return packed.contiguous().view(torch.int32)


def gathered_topk(positions: torch.Tensor, scores: torch.Tensor, topk: int, cp):
    """`global_topk` by all-gathering every rank's candidates (the naive twin; n the same on
    every rank, positions sent as int32)."""
    every_pos = torch.cat(all_gather(positions.to(torch.int32), cp), dim=1).long()
    every_sc = torch.cat(all_gather(scores, cp), dim=1)
    return select_candidates(every_sc, every_pos, topk, with_scores=True)


def shard_topk(positions: torch.Tensor, scores: torch.Tensor, topk: int, cp):
    """The global top-k of every rank's [B, n] candidates by the exchange that moves fewer
    bytes per query (`plan.traffic.candidate_bytes_per_query`): the all-gather at W = 2,
    the radix select from W = 3. Same result either way."""
    n, s = positions.shape[1], scores.element_size()
    if gathered_topk_bytes_per_query(cp.world, n, s) <= radix_topk_bytes_per_query(cp.world, topk, s):
        return gathered_topk(positions, scores, topk, cp)
    return global_topk(positions, scores, topk, cp)
