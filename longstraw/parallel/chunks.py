"""What a divided layer needs to know: `Divided` (a divided capture: this rank's own
positions of the whole prompt) and `DividedChunk` (one chunk of a divided reverse walk),
both applying the deal of `parallel/deal.py`. The models' divided phases read them
(`models/attention.py`, `gated_deltanet.py`, `mla.py`); `parallel/divided.py` makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.parallel.collectives import GatherRows, SumGradAcrossRanks
from longstraw.parallel.deal import Deal


@dataclass(frozen=True)
class Divided:
    """What a divided capture's layers need to know (phase DIVIDED).

    Fields:
        total: positions captured (0 .. total - 1), all ranks together.
        rank, world, block: the round-robin deal (block b on rank b % world).
        cp: the `parallel.context.ContextParallel` (None: one process).
        snapshots: sorted positions where GDN layers keep a snapshot on every rank (the
            end; exact mode: also every chunk boundary).
        chunk_size: tokens per MLP piece, and rows per fetched K/V piece.
    """

    total: int
    rank: int
    world: int
    block: int
    cp: object
    snapshots: tuple[int, ...]
    chunk_size: int

    @property
    def deal(self) -> Deal:
        return Deal(world=self.world, block=self.block)

    def owner(self, position: int) -> int:
        return self.deal.owner(position)

    def blocks(self) -> list[tuple[int, int, int]]:
        """This rank's blocks: (first position, end position, first local row)."""
        return self.deal.blocks(self.rank, self.total)

    def positions(self, device=None) -> torch.Tensor:
        """This rank's positions [N], increasing."""
        rows = torch.arange(self.deal.count(self.total, self.rank), device=device)  # (N,)
        return self.deal.position(rows, self.rank)

    def local_row(self, position: int) -> int:
        """Row of an own position in this rank's [N, ..] tensors."""
        return self.deal.row(position)

    def segments(self) -> list[tuple[int, int]]:
        """This rank's GDN segments: its blocks cut at the snapshot positions, (first, end)."""
        out = []
        for a, b, _ in self.blocks():
            cuts = [a] + [p for p in self.snapshots if a < p < b] + [b]
            out += list(zip(cuts, cuts[1:]))
        return out


def chunk_rows(start: int, end: int, world: int, block: int, device=None) -> list[torch.Tensor]:
    """Per rank, the indices [n_s] (within the chunk [start, end), increasing) of its
    positions. One stable argsort of the owners on `device`, split by the counts the
    deal gives: no `nonzero`, so no host sync."""
    deal = Deal(world=world, block=block)
    owner = deal.owner(torch.arange(start, end, device=device))  # (T,)
    order = torch.argsort(owner, stable=True)  # (T,): rank 0's rows, then rank 1's, ...
    return list(order.split(deal.counts(start, end)))


@dataclass(frozen=True)
class DividedChunk:
    """One chunk [start, end) of a divided reverse walk (exact mode, phase RECOMPUTE): this
    rank recomputes, with autograd, only the positions of the chunk it owns (block b on
    rank b % world).

    Fields:
        start, end: the chunk's absolute positions.
        rank, world, block: the round-robin deal of the sharded state.
        cp: the `parallel.context.ContextParallel`.
        chunk_size: the capture chunk (a hybrid's walk chunk is whole capture chunks).
    """

    start: int
    end: int
    rank: int
    world: int
    block: int
    cp: object
    chunk_size: int
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> rows()

    def rows(self, device=None) -> list[torch.Tensor]:
        """Per rank, the indices [n_s] (within the chunk, increasing) of its positions:
        computed once per device (`chunk_rows`), then the same tensors on every call (every
        layer of the chunk's recomputation asks, forward and backward)."""
        key = torch.device("cpu") if device is None else torch.device(device)
        if key not in self._rows:
            self._rows[key] = chunk_rows(self.start, self.end, self.world, self.block, key)
        return self._rows[key]

    def host_rows(self) -> list[int]:
        """rows()[rank] as host ints, made without tensors (in a rehearsal's fake mode every
        new tensor is fake, so its values cannot be read)."""
        deal = Deal(world=self.world, block=self.block)
        return [i for i in range(self.end - self.start) if deal.owner(self.start + i) == self.rank]

    def positions(self, device=None) -> torch.Tensor:
        """This rank's positions of the chunk [n], increasing."""
        return self.rows(device)[self.rank] + self.start

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., n, F] of this rank's rows of the chunk -> [.., T, F], every rank's rows in
        chunk order (`GatherRows`: one all-gather; backward keeps this rank's rows)."""
        return GatherRows.apply(x, self.rows(x.device), self.cp)

    def own_rows(self, out: torch.Tensor, rows_dim: int = -2) -> torch.Tensor:
        """out with T chunk rows at `rows_dim` (-2 or 0), the same on every rank (the whole
        chunk's attention or recurrence) -> this rank's n rows. Their gradient is summed over
        ranks (`SumGradAcrossRanks`), so the replicated part's backward sees the whole
        chunk's upstream gradient, identical on every rank."""
        summed = SumGradAcrossRanks.apply(out, self.cp)
        mine = self.rows(out.device)[self.rank]
        return summed[mine] if rows_dim == 0 else summed[..., mine, :]
