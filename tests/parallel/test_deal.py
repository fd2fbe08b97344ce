"""parallel.deal: the round-robin arithmetic against its naive twin (enumerate every
position and ask whose block it is), on ints and LongTensors."""

import itertools

import pytest
import torch

from longstraw.parallel.deal import Deal


def naive_rows(deal: Deal, total: int) -> list[list[int]]:
    """Per rank, its positions of [0, total) in increasing order."""
    rows = [[] for _ in range(deal.world)]
    for p in range(total):
        rows[(p // deal.block) % deal.world].append(p)
    return rows


GEOMETRIES = [(1, 1), (1, 4), (2, 1), (2, 3), (3, 2), (4, 5), (5, 7)]


@pytest.mark.parametrize("world,block", GEOMETRIES)
def test_every_formula_equals_the_enumeration(world, block):
    deal = Deal(world, block)
    total = 3 * world * block + 2
    rows = naive_rows(deal, total)
    for p in range(total):
        owner = deal.owner(p)
        assert p in rows[owner]
        assert deal.row(p) == rows[owner].index(p)
        assert deal.position(deal.row(p), owner) == p
    for n, s in itertools.product(range(-1, total + 1), range(world)):
        assert deal.count(n, s) == sum(q < n for q in rows[s])
    for n in range(total + 1):
        assert deal.fullest(n) == max(deal.count(n, s) for s in range(world))
    for s in range(world):
        got = [p for a, b, r in deal.blocks(s, total) for p in range(a, b)]
        assert got == rows[s]
        assert [r for _, _, r in deal.blocks(s, total)] == [rows[s].index(a) for a, _, _ in deal.blocks(s, total)]
    for start, end in [(0, total), (1, total - 1), (block, 2 * block + 1), (5, 5)]:
        assert deal.counts(start, end) == [sum(start <= q < end for q in rows[s]) for s in range(world)]


@pytest.mark.parametrize("world,block", GEOMETRIES)
def test_tensors_take_the_same_formulas(world, block):
    deal = Deal(world, block)
    positions = torch.arange(-1, 4 * world * block)
    assert deal.count(positions.clamp_min(0), 1 % world).tolist() == [
        deal.count(int(p), 1 % world) for p in positions.clamp_min(0)]
    own = torch.arange(0, 3 * world * block)
    assert deal.owner(own).tolist() == [deal.owner(int(p)) for p in own]
    assert deal.row(own).tolist() == [deal.row(int(p)) for p in own]
    rows = torch.arange(0, 2 * block)
    assert deal.position(rows, world - 1).tolist() == [deal.position(int(r), world - 1) for r in rows]


def test_a_bad_deal_is_refused():
    with pytest.raises(ValueError, match="block >= 1"):
        Deal(2, 0)
