"""The divided indexer's per-piece merge as one registered op (`parallel/indexer_pieces.py`):
its declared workspace bounds the plain loop's measured peak from above, within 2% for
float32 scores (float32 and bf16 queries) and 10% for float64 (the CPU reference, whose
threshold selection is bounded coarser), for blocks that see all, part or a prefix of the
piece; the declared FLOPs are the loop's matmuls; and on fake tensors the divided indexer's
op count does not grow with its query blocks. Values: tests/parallel/test_divided_dsa.py
(which runs through the op) against the naive twin."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.parallel.divided_dsa import divided_indexer_topk
from longstraw.parallel.indexer_pieces import indexer_piece_topk, merge_piece, workspace_bytes
from longstraw.rehearsal.tracker import LiveBytes
from tests.op_checks import assert_op_is_its_loop

N, HI, DI, TOPK = 48, 4, 16, 12


def _case(dtype, n_keys=80, seed=0):
    """This rank's 48 queries at positions 100.. (every other), a piece of keys at 60.. in
    steps of 2 (the last ones after some queries), running selections from an earlier piece."""
    gen = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q_pos = 100 + 2 * torch.arange(N)
    k_pos = 61 + 2 * torch.arange(n_keys)
    best = torch.randint(0, 50, (N, TOPK), generator=gen)
    best[:, -3:] = -1
    best_sc = torch.where(best >= 0, torch.rand(N, TOPK, generator=gen, dtype=torch.float64), float("-inf")).to(acc)
    blocks = []
    for b0 in range(0, N, 16):
        b1 = min(N, b0 + 16)
        blocks += [b0, b1, int((k_pos <= q_pos[b1 - 1]).sum())]
    return [mk(N, HI, DI), mk(N, HI).abs(), mk(n_keys, DI), q_pos, k_pos, blocks, 0.4, 32, best, best_sc]


def _loop_peak(args) -> int:
    tracker = LiveBytes("cpu")
    tracker.adopt([x for x in args if isinstance(x, torch.Tensor)])
    with tracker, tracker.phase("op"):
        merge_piece(*args)
    return tracker.phase_peaks["op"] - tracker.live


@pytest.mark.parametrize("n_keys", [20, 80, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_declared_workspace_bounds_the_loop_s_peak(dtype, n_keys):
    args = _case(dtype, n_keys)
    peak, declared = _loop_peak(args), workspace_bytes(*args)
    assert peak <= declared <= (1.10 if dtype == torch.float64 else 1.02) * peak, (peak, declared, declared / peak)


def test_the_declared_flops_are_the_loop_s_matmuls_and_the_op_is_the_loop():
    assert_op_is_its_loop(indexer_piece_topk, merge_piece, _case(torch.float64), mutated=[-2, -1])


def test_on_fake_tensors_the_divided_indexer_s_ops_do_not_grow_with_query_blocks():
    def ops(query_block):
        real = [torch.randn(64, HI, DI), torch.rand(64, HI), torch.randn(64, DI)]
        with FakeTensorMode() as mode:
            q_idx, weights, keys = (mode.from_tensor(x) for x in real)
            tracker = LiveBytes("cpu")
            with tracker:
                got = divided_indexer_topk(q_idx, weights, keys, 8, scale=0.3, positions=64, rank=0, world=1,
                                           block=4, cp=None, piece_rows=16, query_block=query_block, key_block=8)
        assert got.shape == (64, 8)
        return tracker.ops

    assert ops(2) == ops(64)  # 32 query blocks a piece or one: one op a piece either way
