"""DSA's selection as one registered op (`ops/ranked.py`, `longstraw::ranked_topk`): the
op returns what its plain implementation does (float32 and float64, an expanded positions
view, rows with fewer valid entries than k, k > n), its declared workspace bounds the plain
implementation's measured peak from above (within 2% for float32 scores where n >> k, as
DSA's candidates are; 15% at worst), and on fake tensors a selection is one op. Its order against sorting
every candidate: tests/ops/test_dsa.py."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.ops.ranked import rank_entries, ranked_topk, workspace_bytes
from longstraw.rehearsal.tracker import LiveBytes


def _case(dtype, b, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (b, n), generator=gen).to(dtype)  # many ties
    positions = torch.randperm(10 * n, generator=gen)[:n]
    valid = torch.rand(b, n, generator=gen) > 0.2
    valid[0, 2:] = False  # a row with two valid entries
    return scores, positions[None].expand(b, n), valid


@pytest.mark.parametrize("n,k", [(1000, 12), (1000, 200), (300, 300), (30, 40), (3000, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_op_is_its_implementation_and_its_workspace_bounds_the_peak(dtype, n, k):
    scores, positions, valid = _case(dtype, 4, n)
    got, want = ranked_topk(scores, positions, valid, k), rank_entries(scores, positions, valid, k)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    tracker = LiveBytes("cpu")
    tracker.adopt([scores, positions, valid])
    base = tracker.live
    with tracker, tracker.phase("op"):
        rank_entries(scores, positions, valid, k)
    peak, declared = tracker.phase_peaks["op"] - base, workspace_bytes(scores, positions, valid, k)
    tight = dtype == torch.float32 and n >= 10 * k  # DSA's candidates: float32, n >> k
    assert peak <= declared <= (1.02 if tight else 1.15) * peak, (peak, declared)


def test_on_fake_tensors_a_selection_is_one_op():
    real = _case(torch.float32, 4, 100)
    with FakeTensorMode() as mode:
        scores, positions, valid = (mode.from_tensor(x) for x in real)
        tracker = LiveBytes("cpu")
        with tracker:
            out_pos, out_sc = ranked_topk(scores, positions, valid, 8)
    assert tracker.ops == 1 and out_pos.shape == out_sc.shape == (4, 8) and out_pos.dtype == torch.long
