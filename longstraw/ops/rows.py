"""The row layout of attention over a shared prefix, for a batch of branches.

Queries in head layout [B, H, T, ...] (B branches replayed together, H query heads, T
tokens each) become rows per kv head [Hkv, B*g*T, ...] (g = H / Hkv): every query row
that reads kv head j, of every branch, is a row of j. A shared prefix (the prompt state,
never copied per branch) is then attended by all B*g*T rows at once, with no mask (GQA
and the batch fold alike), while each branch's own causal part keeps the head layout.
Row (b, i, t) of kv head j is head j*g + i of token t of branch b. With B = 1 this is
the layout `flash.FlashAttention` and `attention.prefix_causal_attention` always used
(a reshape, no copy)."""

from __future__ import annotations

import torch


def to_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """x [B, H, T, *rest] -> [Hkv, B*g*T, *rest] (a copy when B > 1)."""
    b, h, t, *rest = x.shape
    g = h // kv_heads
    return x.reshape(b, kv_heads, g, t, *rest).movedim(0, 1).reshape(kv_heads, b * g * t, *rest)


def from_rows(x: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """x [Hkv, B*g*T, *rest] -> [B, H, T, *rest], the inverse of `to_rows`."""
    hkv, m, *rest = x.shape
    g = heads // hkv
    t = m // (batch * g)
    return x.reshape(hkv, batch, g, t, *rest).movedim(1, 0).reshape(batch, heads, t, *rest)
