"""DSA's divided capture ops (`parallel.divided_dsa`) in one process (world 1, cp None)
against the naive twins, float64, at every piece size (1, one that does not divide the
shard, one larger than it); their reads of device data; and a run on fake tensors. Across
ranks they are checked end to end in tests/parallel/test_distributed.py."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw import host
from longstraw.ops.naive import naive_indexer_topk, naive_sparse_attention
from longstraw.parallel import divided_dsa
from longstraw.parallel.divided_dsa import divided_indexer_topk, divided_sparse_attention

P, H, R, DR, HI, DI = 17, 3, 6, 4, 3, 8  # positions, heads, latent rank, rope dim, indexer heads / dim
ONE = dict(rank=0, world=1, block=3, cp=None)


def _ints(g, *shape):
    return torch.randint(-3, 4, shape, generator=g).to(torch.float64)


def _sparse_case(g, topk):
    q = torch.randn(H, P, R + DR, generator=g, dtype=torch.float64)
    k = torch.randn(P, R + DR, generator=g, dtype=torch.float64)
    pos = torch.arange(P)
    scores = torch.randn(P, P, generator=g, dtype=torch.float64)  # any selection of visible positions
    indices = naive_indexer_topk(scores[:, :, None], torch.ones(P, 1, dtype=torch.float64),
                                 torch.eye(P, dtype=torch.float64), pos, pos, topk, 1.0)
    return q, k, indices, naive_sparse_attention(q, k, k[:, :R], pos, indices, pos, 0.3)


@pytest.mark.parametrize("piece_rows", [1, 5, 100])
def test_indexer_topk_is_the_global_selection_ties_to_the_lower_position(piece_rows):
    """Integer data (exact scores whatever the summation order) with duplicated keys, so
    equal scores meet at the top-k boundary and across pieces."""
    g = torch.Generator().manual_seed(3)
    keys = _ints(g, P, DI)
    keys[7] = keys[2]
    keys[12] = keys[2]
    keys[15] = keys[9]
    q_idx = _ints(g, P, HI, DI)
    weights = torch.round((torch.rand(P, HI, generator=g, dtype=torch.float64) + 0.5) * 4) / 4  # dyadic: exact sums
    weights[:, 0] = -0.5
    pos = torch.arange(P)
    boundary_ties = 0  # rows where position 2 is in and its twin 7 (visible, same score) is out
    for topk in (1, 3, 8, P, P + 2):
        want = naive_indexer_topk(q_idx, weights, keys, pos, pos, topk, 0.5)
        boundary_ties += sum(2 in row and 7 not in row for row in want[7:].tolist())
        for query_block, key_block in ((1, 1), (4, 3), (1024, 128)):
            got = divided_indexer_topk(q_idx, weights, keys, topk, scale=0.5, positions=P, piece_rows=piece_rows,
                                       query_block=query_block, key_block=key_block, **ONE)
            assert torch.equal(got, want), (topk, query_block, key_block)
    assert boundary_ties


@pytest.mark.parametrize("piece_rows", [1, 5, 100])
def test_sparse_attention_over_fetched_pieces_equals_naive(piece_rows):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(H, P, R + DR, generator=g, dtype=torch.float64)
    k = torch.randn(P, R + DR, generator=g, dtype=torch.float64)
    pos = torch.arange(P)
    for topk in (1, 4, P + 1):  # P + 1: every row padded with -1
        scores = torch.randn(P, P, generator=g, dtype=torch.float64)  # any selection of visible positions
        indices = naive_indexer_topk(scores[:, :, None], torch.ones(P, 1, dtype=torch.float64),
                                     torch.eye(P, dtype=torch.float64), pos, pos, topk, 1.0)
        want = naive_sparse_attention(q, k, k[:, :R], pos, indices, pos, 0.3)
        got = divided_sparse_attention(q, k, indices, value_dim=R, positions=P, scale=0.3, piece_rows=piece_rows,
                                       **ONE)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("entries,queries", [(1, 1), (3, 2), (8, 1024)])
def test_sparse_attention_in_small_blocks_equals_naive(entries, queries, monkeypatch):
    """Blocks of at most `queries` queries and `entries` rows (one query a block where a run is
    wider than `entries`): the same attention."""
    monkeypatch.setattr(divided_dsa, "DIVIDED_SPARSE_ENTRIES", entries)
    monkeypatch.setattr(divided_dsa, "DIVIDED_SPARSE_QUERIES", queries)
    monkeypatch.setattr(divided_dsa, "STATS_QUERY_BLOCK", 4)
    g = torch.Generator().manual_seed(6)
    for topk in (2, 5):
        q, k, indices, want = _sparse_case(g, topk)
        got = divided_sparse_attention(q, k, indices, value_dim=R, positions=P, scale=0.3, piece_rows=5, **ONE)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("piece_rows", [1, 5])
def test_sparse_attention_reads_the_device_once_a_call_and_runs_on_fake_tensors(piece_rows):
    """On fake tensors (a rehearsal): no data-dependent op raises, and the call reads device
    data once (the per-piece counts), at 17 pieces as at 4."""
    with FakeTensorMode():
        q = torch.randn(H, P, R + DR, dtype=torch.float64)
        k = torch.randn(P, R + DR, dtype=torch.float64)
        indices = torch.randint(0, P, (P, 4))
        before = host.HostSyncs.count
        out = divided_sparse_attention(q, k, indices, value_dim=R, positions=P, scale=0.3, piece_rows=piece_rows,
                                       **ONE)
        assert host.HostSyncs.count - before == 1
    assert out.shape == (H, P, R)


def test_piece_stats_count_the_queries_and_widest_runs():
    """The counts that steer the pieces' work: per piece, the queries with entries in it and
    the most entries one has there (here against a direct count), read in one sync."""
    g = torch.Generator().manual_seed(8)
    _, _, indices, _ = _sparse_case(g, 5)
    deal = divided_dsa.Deal(1, 3)
    place = torch.where(indices >= 0, indices, P).sort(dim=1).values
    spans = divided_dsa.piece_spans(deal, P, 4)
    got = divided_dsa._piece_stats(place, spans, P, deal=deal, positions=P, rank=0)
    for (_, r0, r1), (taking, widest) in zip(spans, got):
        inside = ((indices >= r0) & (indices < r1)).sum(1)
        assert (taking, widest) == (int((inside > 0).sum()), int(inside.max()))
