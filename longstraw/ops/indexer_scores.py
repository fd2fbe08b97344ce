"""DSA's indexer scores as one registered op: `longstraw::indexer_scores_into`.

HF's index score of each query for each key, `sum_h w[t, h] * relu(scale * q[t, h] . k)`,
is a loop over blocks of keys (two matmuls a block, bounded temporaries). At the paper's
lengths that loop runs once per (piece, query block) of a divided capture and per query
block of every chunk: registered, it is one op to a rehearsal (fake tensors), the live-byte
tracker (its temporaries declared, `ops/workspace.py`) and the FLOP counter (its formula
declared), as `ops/divided_runs.py` is.

Legend: T queries, Hi indexer heads, Di their dim, n keys, kb = min(key_block, n).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.ops.workspace import declare_workspace

Tensor = torch.Tensor


def score_blocks(q_idx: Tensor, weights: Tensor, keys: Tensor, out: Tensor, scale: float, key_block: int) -> None:
    """The plain loop (the op's implementation): out [T, n] (accumulation dtype) gets the
    scores of q_idx [T, Hi, Di] with head weights [T, Hi] against keys [n, Di]."""
    t, hi, di = q_idx.shape
    acc = out.dtype
    q = q_idx.to(acc).reshape(t * hi, di)
    w = weights.to(acc)[:, None, :]  # [T, 1, Hi]
    for c0 in range(0, keys.shape[0], key_block):
        c1 = min(keys.shape[0], c0 + key_block)
        s = torch.matmul(q, keys[c0:c1].to(acc).T).view(t, hi, c1 - c0).mul_(scale).relu_()
        out[:, c0:c1] = torch.bmm(w, s)[:, 0]
        del s


@torch.library.custom_op("longstraw::indexer_scores_into", mutates_args=("out",))
def indexer_scores_into(q_idx: Tensor, weights: Tensor, keys: Tensor, out: Tensor, scale: float,
                        key_block: int) -> None:
    score_blocks(q_idx, weights, keys, out, scale, key_block)


@indexer_scores_into.register_fake
def _(q_idx, weights, keys, out, scale, key_block):
    return None


def workspace_bytes(q_idx, weights, keys, out, scale, key_block) -> int:
    """The most bytes `score_blocks` holds at once (`scoring_bytes` of the arguments' shapes
    and dtypes)."""
    t, hi, di = q_idx.shape
    return scoring_bytes(t, hi, di, keys.shape[0], key_block, [x.dtype for x in (q_idx, weights, keys)], out.dtype)


def scoring_bytes(t: int, hi: int, di: int, n: int, key_block: int, dtypes: list, acc: torch.dtype) -> int:
    """The most bytes `score_blocks` of t queries over n keys holds at once: the queries and
    weights in the accumulation dtype `acc` (copies where their dtype differs; `dtypes` =
    those of q_idx, weights, keys) and one block's scores [T, Hi, kb], beside either the key
    block's cast copy (while the scores are made) or their weighted sum [T, 1, kb] (after it
    is freed)."""
    if n == 0:
        return 0
    kb, a = min(key_block, n), acc.itemsize

    def cast(dtype, numel):
        return 0 if dtype == acc else numel * a

    q, w, k = dtypes
    return cast(q, t * hi * di) + cast(w, t * hi) + t * hi * kb * a + max(cast(k, kb * di), t * kb * a)


INDEXER_SCORES_INTO = torch.ops.longstraw.indexer_scores_into.default
declare_workspace(INDEXER_SCORES_INTO, workspace_bytes)


@register_flop_formula(torch.ops.longstraw.indexer_scores_into)
def _flops(q_shape, weights_shape, keys_shape, scores_shape, scale, key_block, *args, **kwargs) -> int:
    """The loop's matmuls, as the counter counted them unregistered: 2 T Hi Di n (scores)
    plus 2 T Hi n (the heads' weighted sum)."""
    t, hi, di = q_shape
    return 2 * t * hi * keys_shape[0] * (di + 1)
