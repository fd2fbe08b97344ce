"""`parallel.collectives.gather_rows`: every rank's rows of a chunk in chunk order.

One process plays rank r of W: the all-gather is replaced by the stack of every rank's
padded rows (what the backend hands back), and the result is compared with the naive
twin, one indexed write per rank. Equal and unequal row counts (the deal's usual chunk,
and a chunk's ragged end), leading dims, and a rank with no rows.
"""

from unittest import mock

import pytest
import torch

from longstraw.parallel import collectives
from longstraw.parallel.chunks import chunk_rows


class _Group:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world


def naive_gather(xs: list[torch.Tensor], index: list[torch.Tensor]) -> torch.Tensor:
    """The reference: rank s's rows written at index[s], one write per rank."""
    x0 = xs[0]
    out = x0.new_zeros(*x0.shape[:-2], sum(int(i.numel()) for i in index), x0.shape[-1])
    for x, rows in zip(xs, index):
        out[..., rows, :] = x
    return out


def _stacking(xs: list[torch.Tensor]):
    """An `all_gather_stacked` that hands back every rank's rows, padded as each rank pads them."""

    def stacked(padded, cp):
        most = padded.shape[-2]
        parts = []
        for x in xs:
            p = x.new_zeros(*x.shape[:-2], most, x.shape[-1])
            p[..., : x.shape[-2], :] = x
            parts.append(p)
        assert torch.equal(parts[cp.rank], padded)  # this rank's own rows, padded the same way
        return torch.stack(parts)

    return stacked


# (start, end, world, block): equal counts, unequal counts, a rank with none
GEOMETRIES = [(0, 16, 2, 4), (0, 24, 3, 2), (4, 23, 3, 2), (0, 5, 4, 2), (7, 40, 4, 3)]


@pytest.mark.parametrize("start,end,world,block", GEOMETRIES)
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_gather_rows_equals_one_write_per_rank(start, end, world, block, lead, dtype):
    index = chunk_rows(start, end, world, block, torch.device("cpu"))
    g = torch.Generator().manual_seed(start * 31 + end)
    xs = [(torch.randn(*lead, int(i.numel()), 5, generator=g, dtype=torch.float64) * 100).to(dtype) for i in index]
    want = naive_gather(xs, index)
    for rank in range(world):
        with mock.patch.object(collectives, "all_gather_stacked", _stacking(xs)):
            got = collectives.gather_rows(xs[rank], index, _Group(rank, world))
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_gather_rows_holds_two_gathered_buffers_at_most():
    """Under leading dims the gathered rows are reordered through one copy: the all-gather's
    buffer is dropped before the output is made, so no more than two gathered-sized
    buffers are alive at once (as the per-rank writes held: the buffer and the output)."""
    from longstraw.rehearsal.tracker import LiveBytes

    index = chunk_rows(0, 48, 3, 4, torch.device("cpu"))
    xs = [torch.randn(4, 6, int(i.numel()), 32, dtype=torch.float64) for i in index]
    gathered = sum(x.numel() for x in xs) * 8
    tracker = LiveBytes("cpu")
    tracker.adopt(xs)
    with mock.patch.object(collectives, "all_gather_stacked", _stacking(xs)), tracker, tracker.phase("gather"):
        out = collectives.gather_rows(xs[1], index, _Group(1, 3))
    assert torch.equal(out, naive_gather(xs, index))
    held = tracker.phase_peaks["gather"] - sum(x.numel() for x in xs) * 8
    assert held <= 2 * gathered + 4096, (held, gathered)  # index tensors: a few KB
