"""One round of the global top-k's radix select (`parallel.topk`), as two registered ops
around its all-reduce: `longstraw::radix_histogram` and `longstraw::radix_narrow`.

A round counts, per row, the candidates still tied with the cut in each of the 16 bins of
one 4-bit digit; the ranks sum the counts (an all-reduce); each row then keeps the bin that
holds its need-th candidate. The rounds cannot be batched (each needs the previous one's
bins), and a selection takes 16 of them (24 for float64 scores), each a dozen small ops.
Replay and generation select once per layer and piece, so on a GLM-5.2 rehearsal the
rounds were 38-45% of all ops (`bench/rehearse_op_sites.py`). As two ops a round they are
two calls to anything that watches ops, with their temporaries declared as workspace
(`ops/workspace.py`). The real implementations are the plain torch below.

    longstraw::radix_histogram(word, match, shift, sign) -> hist        [B, 16] int32
    longstraw::radix_narrow(hist, word, match(a!), need(a!), value(a!), shift, sign) -> ()

Shapes: word [B, n] int64 (one word of each candidate's order key), match [B, n] bool (the
candidates tied with the cut so far), need [B] int64 (the rank of the cut among them),
value [B] int64 (the cut's word, built digit by digit); shift: the digit's lowest bit;
sign: the word's top digit, read as a signed one (-8..7 -> bins 0..15).
"""

from __future__ import annotations

import torch

from longstraw.ops.workspace import declare_workspace

Tensor = torch.Tensor

DIGIT_BITS = 4
BINS = 1 << DIGIT_BITS


def digits(word: Tensor, shift: int, sign: bool) -> Tensor:
    """[B, n] int64: each candidate's bin, 0..15, of the digit at `shift`."""
    if sign:
        return (word >> shift) + BINS // 2  # the sign digit: -8..7 -> 0..15
    return (word >> shift) & (BINS - 1)


def histogram(word: Tensor, match: Tensor, shift: int, sign: bool) -> Tensor:
    """[B, 16] int32: this rank's count of the matching candidates in each bin (the op's implementation)."""
    hist = torch.zeros(word.shape[0], BINS, dtype=torch.int32, device=word.device)
    hist.scatter_add_(1, torch.where(match, digits(word, shift, sign), 0), match.to(torch.int32))
    return hist


def narrow(hist: Tensor, word: Tensor, match: Tensor, need: Tensor, value: Tensor, shift: int, sign: bool) -> None:
    """Per row, the bin of the all-ranks counts `hist` that holds the need-th candidate: its
    digit goes into value, need drops by the candidates in the bins above, and match keeps
    the candidates in that bin (the op's implementation)."""
    at_or_above = hist.flip(1).cumsum(1).flip(1)  # [B, 16]: candidates in bins >= d
    d = ((at_or_above >= need[:, None]).sum(1) - 1).clamp(min=0)  # the bin holding the need-th
    need -= (at_or_above.gather(1, d[:, None]) - hist.gather(1, d[:, None]))[:, 0]
    value += (d - BINS // 2 if sign else d) << shift
    match &= digits(word, shift, sign) == d[:, None]


@torch.library.custom_op("longstraw::radix_histogram", mutates_args=())
def radix_histogram(word: Tensor, match: Tensor, shift: int, sign: bool) -> Tensor:
    return histogram(word, match, shift, sign)


@radix_histogram.register_fake
def _(word, match, shift, sign):
    return word.new_empty(word.shape[0], BINS, dtype=torch.int32)


@torch.library.custom_op("longstraw::radix_narrow", mutates_args=("match", "need", "value"))
def radix_narrow(hist: Tensor, word: Tensor, match: Tensor, need: Tensor, value: Tensor, shift: int,
                 sign: bool) -> None:
    narrow(hist, word, match, need, value, shift, sign)


@radix_narrow.register_fake
def _(hist, word, match, need, value, shift, sign):
    return None


def histogram_bytes(word, match, shift, sign) -> int:
    """`radix_histogram`'s peak: its [B, 16] int32 output beside the digits (the shift, then
    the mask or the offset: two [B, n] int64 at once) and a scalar."""
    b, n = word.shape
    return 16 * b * n + 4 * b * BINS + 8


def narrow_bytes(hist, word, match, need, value, shift, sign) -> int:
    """`radix_narrow`'s peak: the larger of the counts' flips and cumulative sum ([B, 16]
    int32 and int64) and, beside the int64 cumulative counts and the [B] bins, the digits
    (two [B, n] int64 at once)."""
    b, n = word.shape
    return max(16 * b * BINS, 8 * b * BINS + 16 * b + 16 * b * n)


declare_workspace(torch.ops.longstraw.radix_histogram.default, histogram_bytes)
declare_workspace(torch.ops.longstraw.radix_narrow.default, narrow_bytes)
