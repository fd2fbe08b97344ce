"""The divided capture's attention ops in one process (world 1, cp None) against the naive
twins, float64: every piece size (1, one that does not divide the shard, one larger than it).
Across ranks they are checked end to end in tests/parallel/test_distributed.py
(`test_divided_capture_at_awkward_block_and_chunk_boundaries`)."""

import pytest
import torch

from longstraw.parallel.attention import divided_causal_attention
from longstraw.ops.naive import naive_attention

P, H, R, DR, HI, DI = 17, 3, 6, 4, 3, 8  # positions, heads, latent rank, rope dim, indexer heads / dim
ONE = dict(rank=0, world=1, block=3, cp=None)


def _ints(g, *shape):
    return torch.randint(-3, 4, shape, generator=g).to(torch.float64)


@pytest.mark.parametrize("piece_rows", [1, 5, 100])
def test_latent_rows_fetched_once_give_causal_attention(piece_rows):
    """v None: the value is the key rows' first R columns (absorbed MLA's latent)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(H, P, R + DR, generator=g, dtype=torch.float64)
    k = torch.randn(1, P, R + DR, generator=g, dtype=torch.float64)
    scores = (q @ k[0].T * 0.3).masked_fill(torch.ones(P, P, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, dim=-1) @ k[0, :, :R]
    got = divided_causal_attention(q, k, None, value_dim=R, positions=P, scale=0.3, piece_rows=piece_rows, **ONE)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [1, 2, 5, 8])
@pytest.mark.parametrize("piece_rows", [1, 5, 100])
def test_sliding_window_over_fetched_pieces_equals_naive(window, piece_rows):
    """A window (by position) across blocks of 3: each query sees its last `window` keys,
    own block and fetched pieces alike; pieces wholly before a block's window are skipped."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, P, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, P, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, P, 6, generator=g, dtype=torch.float64)
    pos = torch.arange(P)
    got = divided_causal_attention(q, k, v, positions=P, scale=0.3, piece_rows=piece_rows, window=window, **ONE)
    torch.testing.assert_close(got, naive_attention(q, k, v, pos, pos, 0.3, window=window), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dv", [8, 6])  # 8: the fused kernel takes it (runs join); 6: blockwise (a block a call)
@pytest.mark.parametrize("query_rows", [1, 4, 7, 100])
@pytest.mark.parametrize("piece_rows", [1, 5, 100])
def test_blocks_that_see_a_whole_piece_attend_together(query_rows, piece_rows, dv, monkeypatch):
    """GQA with sinks: the own blocks that see the same rows of a fetched piece join into one
    partial of up to `query_rows` rows (at least a block) where the fused kernel runs it; the
    result equals naive attention, and more rows a partial means fewer partials."""
    import longstraw.ops.divided_runs as runs

    g = torch.Generator().manual_seed(7)
    q = torch.randn(4, P, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, P, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, P, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    calls = []
    real = runs.partial_attention
    monkeypatch.setattr(runs, "partial_attention", lambda q, *a, **kw: calls.append(q.shape[1]) or real(q, *a, **kw))
    got = divided_causal_attention(q, k, v, positions=P, scale=0.3, piece_rows=piece_rows, sinks=sinks,
                                   query_rows=query_rows, **ONE)
    pos = torch.arange(P)
    torch.testing.assert_close(got, naive_attention(q, k, v, pos, pos, 0.3, sinks=sinks), rtol=0, atol=1e-12)
    block = ONE["block"]
    assert max(calls) <= (max(query_rows, block) if dv == 8 else block)
    blocks = -(-P // block)
    if piece_rows == 1 and query_rows == 100:  # a diagonal per block, then a partial per row before the last block:
        fused = blocks + (blocks - 1) * block  # the later blocks in one run (fused), or each block alone
        alone = blocks + sum(blocks - 1 - r // block for r in range((blocks - 1) * block))
        assert len(calls) == (fused if dv == 8 else alone)
