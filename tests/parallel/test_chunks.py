"""The divided reverse walk's chunk geometry (`models/routing.py`, `DividedChunk`).

`rows()` is read by every layer of a walk chunk's recomputation, forward and backward:
it must equal the naive per-rank `nonzero` of the round-robin owners, and be computed
once per chunk (the naive form forces W host syncs per call on a GPU).
"""

from unittest import mock

import pytest
import torch

from longstraw.parallel import chunks as divided
from longstraw.parallel.chunks import DividedChunk
from longstraw.parallel.deal import Deal


def naive_rows(start: int, end: int, world: int, block: int) -> list[torch.Tensor]:
    """The reference: per rank, nonzero of (position // block) % world == rank."""
    owner = torch.div(torch.arange(start, end), block, rounding_mode="floor") % world
    return [torch.nonzero(owner == s)[:, 0] for s in range(world)]


GEOMETRIES = [(0, 12, 2, 3), (0, 1, 2, 3), (5, 6, 3, 4), (4, 23, 3, 2), (7, 40, 4, 3), (1, 17, 3, 5),
              (0, 96, 8, 4), (13, 14, 1, 7), (9, 31, 5, 1), (2, 3, 4, 4), (0, 7, 3, 8)]


@pytest.mark.parametrize("start,end,world,block", GEOMETRIES)
def test_rows_equal_the_naive_owners(start, end, world, block):
    want = naive_rows(start, end, world, block)
    assert Deal(world, block).counts(start, end) == [int(w.numel()) for w in want]
    for rank in range(world):
        chunk = DividedChunk(start=start, end=end, rank=rank, world=world, block=block, cp=None, chunk_size=4)
        got = chunk.rows()
        assert len(got) == world
        for g, w in zip(got, want):
            assert g.dtype == torch.long and torch.equal(g, w)
        assert torch.equal(chunk.positions(), want[rank] + start)


def test_rows_are_computed_once_per_chunk():
    chunk = DividedChunk(start=6, end=30, rank=1, world=3, block=2, cp=None, chunk_size=6)
    with mock.patch.object(divided, "chunk_rows", wraps=divided.chunk_rows) as computed, \
            mock.patch.object(torch, "nonzero", side_effect=AssertionError("rows() must not call nonzero")):
        first = chunk.rows()
        for _ in range(5):  # every layer asks, forward and backward
            assert chunk.rows() is first
            chunk.positions()
        chunk.rows(torch.device("cpu"))
    assert computed.call_count == 1
    other = DividedChunk(start=6, end=30, rank=1, world=3, block=2, cp=None, chunk_size=6)
    assert other == chunk and other.rows() is not first  # a new chunk computes its own
