"""The round-robin deal of prompt positions over context-parallel ranks: the one home of
its arithmetic, torch-free (the planner uses it without torch; the engine's state, ops and
models use it on ints and on LongTensors alike).

Positions are cut into blocks of `block`; block b belongs to rank b % world, so causal work
is balanced across ranks. A rank holds its positions as rows, in increasing order:

    position p  ->  owner  (p // block) % world
                    row    (p // block // world) * block + p % block   (on its owner)
    row r of rank s  ->  position  r // block * (world * block) + s * block + r % block

Every function takes ints or (where it says so) LongTensors: `//`, `%`, `*` and `+` mean the
same on both, and `_clip` clamps either.
"""

from __future__ import annotations

from dataclasses import dataclass


def _clip(x, lo: int, hi: int):
    """min(max(x, lo), hi) for an int or a tensor (elementwise)."""
    if isinstance(x, int):
        return min(max(x, lo), hi)
    return x.clamp(lo, hi)


@dataclass(frozen=True)
class Deal:
    """Blocks of `block` positions dealt round-robin over `world` ranks.

    Fields:
        world: ranks (1: one process holds every position).
        block: positions per block.
    """

    world: int
    block: int

    def __post_init__(self):
        if self.world < 1 or self.block < 1:
            raise ValueError(f"a deal needs world >= 1 and block >= 1, got world={self.world}, block={self.block}")

    @property
    def cycle(self) -> int:
        """Positions in one round of the deal (one block per rank)."""
        return self.world * self.block

    def owner(self, position):
        """The rank that holds `position` (int or LongTensor)."""
        return position // self.block % self.world

    def count(self, n, rank: int):
        """Positions rank `rank` holds in [0, n) (int or LongTensor n; n < 0 counts as 0)."""
        if isinstance(n, int):
            n = max(n, 0)
        full, rem = n // self.cycle, n % self.cycle
        return full * self.block + _clip(rem - rank * self.block, 0, self.block)

    def fullest(self, n: int) -> int:
        """Positions the fullest rank (rank 0) holds in [0, n)."""
        return self.count(n, 0)

    def row(self, position):
        """Row of `position` on its owner (int or LongTensor)."""
        return position // self.cycle * self.block + position % self.block

    def position(self, row, rank: int):
        """Position of row `row` (int or LongTensor) of rank `rank`."""
        return row // self.block * self.cycle + rank * self.block + row % self.block

    def blocks(self, rank: int, total: int) -> list[tuple[int, int, int]]:
        """Rank `rank`'s blocks of [0, total): (first position, end position, first row)."""
        return [(b * self.block, min(total, (b + 1) * self.block), i * self.block)
                for i, b in enumerate(range(rank, -(-total // self.block), self.world))]

    def counts(self, start: int, end: int) -> list[int]:
        """Positions of [start, end) each rank holds, rank by rank."""
        return [self.count(end, s) - self.count(start, s) for s in range(self.world)]


# ----------------------------------------------------------------------------
# the divided reverse walk's chunks (whole cycles of the deal)


def walk_chunk_tokens(positions: int, chunk_size: int, world: int, block: int, at_chunks: bool = False) -> int:
    """Tokens of one chunk of a divided reverse walk: whole cycles of the deal (world x
    block), as many as `chunk_size` needs; `at_chunks` (GDN hybrids): the fewest capture
    chunks that hold a cycle. `parallel.divided.walk_chunks` cuts the walk with it."""
    cycle = Deal(world, block).cycle
    size = -(-cycle // chunk_size) * chunk_size if at_chunks else -(-chunk_size // cycle) * cycle
    return min(positions, size)


def walk_chunk_bounds(positions: int, chunk_size: int, world: int, block: int,
                      at_chunks: bool = False) -> list[tuple[int, int]]:
    """The chunks [(start, end)] of a divided reverse walk (`walk_chunk_tokens` each); a
    shorter last chunk in which some rank would own no block joins the one before it.
    `parallel.divided.walk_chunks` walks exactly these."""
    deal = Deal(world, block)
    size = walk_chunk_tokens(positions, chunk_size, world, block, at_chunks)
    bounds = [(a, min(positions, a + size)) for a in range(0, positions, size)]
    a, b = bounds[-1]
    if len(bounds) > 1 and len({deal.owner(k * block) for k in range(a // block, (b - 1) // block + 1)}) < world:
        bounds[-2:] = [(bounds[-2][0], positions)]
    return bounds
