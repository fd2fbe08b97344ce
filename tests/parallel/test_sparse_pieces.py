"""A divided capture's DSA attention over one fetched piece as one registered op
(`parallel/sparse_pieces.py`): for every piece of a one-process divided attention (float32,
float64 and bf16; wide and one-row runs; several query blocks a piece), the declared
workspace bounds the plain loop's measured peak from above within 5%, and the declared
FLOPs are the loop's einsums; on fake tensors the attention's op count does not grow with
the query blocks. Values: tests/parallel/test_divided_dsa.py (which runs through the op)
against the naive twin."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.ops.naive import naive_indexer_topk
from longstraw.parallel import divided_dsa
from longstraw.parallel.sparse_pieces import attend_piece, divided_sparse_piece, workspace_bytes
from longstraw.rehearsal.tracker import LiveBytes
from tests.op_checks import assert_op_is_its_loop

H, R, DR = 3, 6, 4  # heads, latent rank, rope dim


def _inputs(dtype, positions, topk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(H, positions, R + DR, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(positions, R + DR, generator=gen, dtype=torch.float64).to(dtype)
    pos = torch.arange(positions)
    scores = torch.randn(positions, positions, generator=gen, dtype=torch.float64)
    indices = naive_indexer_topk(scores[:, :, None], torch.ones(positions, 1, dtype=torch.float64),
                                 torch.eye(positions, dtype=torch.float64), pos, pos, topk, 1.0)
    return q, k, indices


def _piece_calls(monkeypatch, dtype, positions, topk, piece_rows, queries=1024):
    """The arguments of every per-piece op call of a one-process divided attention."""
    calls = []
    monkeypatch.setattr(divided_dsa, "divided_sparse_piece", lambda *args: calls.append(args))
    monkeypatch.setattr(divided_dsa, "DIVIDED_SPARSE_QUERIES", queries)
    q, k, indices = _inputs(dtype, positions, topk)
    divided_dsa.divided_sparse_attention(q, k, indices, value_dim=R, positions=positions, scale=0.3, cp=None,
                                         piece_rows=piece_rows, rank=0, world=1, block=3)
    assert calls
    return calls


@pytest.mark.parametrize("positions,topk,piece_rows,queries", [(60, 8, 16, 1024), (200, 40, 64, 1024),
                                                               (100, 100, 7, 1024), (50, 3, 1, 1024),
                                                               (200, 40, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_declared_workspace_bounds_the_loop_s_peak_within_five_percent(monkeypatch, dtype, positions, topk,
                                                                            piece_rows, queries):
    for args in _piece_calls(monkeypatch, dtype, positions, topk, piece_rows, queries):
        tracker = LiveBytes("cpu")
        tracker.adopt([x for x in args if isinstance(x, torch.Tensor)])
        with tracker, tracker.phase("op"):
            attend_piece(*args)
        peak = tracker.phase_peaks["op"] - tracker.live
        declared = workspace_bytes(*args)
        assert peak <= declared <= 1.05 * peak, (peak, declared, args[5:])


def test_the_declared_flops_are_the_loop_s_einsums(monkeypatch):
    for args in _piece_calls(monkeypatch, torch.float64, 60, 8, 16, queries=7):
        assert_op_is_its_loop(divided_sparse_piece, attend_piece, list(args), mutated=[3, 4])


def test_on_fake_tensors_the_attention_s_ops_do_not_grow_with_query_blocks(monkeypatch):
    real = _inputs(torch.float32, 64, 8)

    def ops(queries):
        monkeypatch.setattr(divided_dsa, "DIVIDED_SPARSE_QUERIES", queries)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            q, k, indices = (mode.from_tensor(x) for x in real)
            tracker = LiveBytes("cpu")
            with tracker:
                out = divided_dsa.divided_sparse_attention(q, k, indices, value_dim=R, positions=64, scale=0.3,
                                                           cp=None, piece_rows=16, rank=0, world=1, block=4)
        assert out.shape == (H, 64, R)
        return tracker.ops

    assert ops(2) == ops(1024)  # up to 32 query blocks a piece or one: one op a piece either way
