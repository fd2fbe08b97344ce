"""Per-branch decode state: what each of the G rollout branches keeps of its OWN tokens.

The prompt state (`prompt.py`) is shared by every branch and only read while decoding.
Each branch adds only what its own tokens need, allocated once for `capacity` positions:

    attention layer   BranchKV      k [G, Hkv, capacity, D], v [G, Hkv, capacity, Dv]
    Gated DeltaNet    BranchRecurrent  recurrent [G, Hv, Dk, Dv] (fp32) + conv tail
                                    [G, C, K-1]: one copy of the constant-size state each
    MLA (+ DSA)       BranchLatent  latent rows [G, capacity, R + Dr] (+ indexer keys
                                    [G, capacity, Di])

Every branch's row j is the token at absolute position `start + j` (start = P - 1, the
position of the prompt's last token, which every branch feeds first). Branches advance
at their own pace (an agent episode absorbs an environment's observation into one branch
as a chunk), so each keeps its own length: `lengths[i]` rows of branch i are filled.

A decode step runs a subset of branches (`rows`, branch indices), each at its own
position: branch i's new token goes into its row `lengths[i]`, and readers take the
rows up to the longest of them with each branch's `lengths` to mask the rest
(`ops/decode_attention.py`). A chunk absorbed into ONE branch runs the
capture path against the stacked states [prompt, `BranchState.view(i)`]: the view is a
`PromptState` whose layers alias branch i's rows, so capture writes them in place
(`BranchState.settle(i, view)` then records the new length and recurrent state).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.state.prompt import AttentionKV, IndexKeys, LatentKV, MLAState, PromptState, RecurrentState
from longstraw.tensors import nbytes


def pick(t: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """t[rows] along dim 0: the tensor itself (a view) when rows is None or every row in order."""
    if rows is None or rows == list(range(t.shape[0])):
        return t
    return t[torch.tensor(rows, device=t.device)]


def put(t: torch.Tensor, rows: list[int] | None, value: torch.Tensor) -> None:
    """t[rows] = value along dim 0, in place."""
    if rows is None or rows == list(range(t.shape[0])):
        t.copy_(value)
    else:
        t[torch.tensor(rows, device=t.device)] = value.to(t.dtype)


class _Lengths:
    """Per-branch row counts (mixed into the row-holding branch states)."""

    lengths: list

    def lengths_of(self, rows: list[int] | None) -> list[int]:
        """The rows filled by each branch in `rows` (None: all)."""
        return [self.lengths[i] for i in (range(len(self.lengths)) if rows is None else rows)]

    def longest(self, rows: list[int] | None) -> int:
        """The most rows any branch in `rows` has filled (readers take that many, masked)."""
        return max(self.lengths_of(rows))

    def length_of(self, rows: list[int] | None) -> int:
        """The rows filled by every branch in `rows` (None: all), which must agree."""
        got = set(self.lengths_of(rows))
        assert len(got) == 1, f"branches of one decode step hold different lengths: {sorted(got)}"
        return got.pop()

    def grow(self, rows: list[int] | None, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance `rows`' lengths by one; returns (branch indices [B], their lengths
        before [B]) as index tensors: where each branch's new row goes."""
        before = self.lengths_of(rows)
        assert max(before) < capacity, f"{type(self).__name__} overflow: more tokens than its capacity {capacity}"
        index = list(range(len(self.lengths))) if rows is None else list(rows)
        for i in index:
            self.lengths[i] += 1
        return torch.tensor(index), torch.tensor(before)


@dataclass
class BranchKV(_Lengths):
    """Own K/V of the G branches for one attention layer.

    Fields:
        k: [G, Hkv, capacity, D]; v: [G, Hkv, capacity, Dv].
        start: absolute position of row 0. lengths: rows filled per branch.
        window: the layer's sliding window (None: full attention).
    """

    k: torch.Tensor
    v: torch.Tensor
    start: int
    lengths: list = field(default_factory=list)
    window: int | None = None

    def __post_init__(self):
        if not self.lengths:
            self.lengths = [0] * self.k.shape[0]

    @classmethod
    def empty(cls, *, branches: int, kv_heads: int, head_dim: int, v_head_dim: int, capacity: int, start: int,
              window: int | None, dtype, device) -> "BranchKV":
        k = torch.empty(branches, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        v = torch.empty(branches, kv_heads, capacity, v_head_dim, dtype=dtype, device=device)
        return cls(k=k, v=v, start=start, window=window)

    @torch.no_grad()
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, rows: list[int] | None = None) -> None:
        """Write one token per branch of `rows` (None: all): k_new [B, Hkv, 1, D], v_new [B, Hkv, 1, Dv]."""
        assert k_new.shape[2] == 1, k_new.shape
        branch, row = (t.to(self.k.device) for t in self.grow(rows, self.k.shape[2]))
        self.k[branch, :, row] = k_new[:, :, 0].to(self.k.dtype)  # (B, Hkv, D): each branch at its own row
        self.v[branch, :, row] = v_new[:, :, 0].to(self.v.dtype)

    def keys(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k [B, Hkv, n, D], v [B, Hkv, n, Dv]) of `rows` (None: all), n the longest
        branch's filled rows (mask a shorter branch's by `lengths_of`)."""
        n = self.longest(rows)
        return pick(self.k[:, :, :n], rows), pick(self.v[:, :, :n], rows)

    def view(self, i: int) -> AttentionKV:
        """Branch i's rows as an `AttentionKV` (aliasing them: appends write in place)."""
        n = self.lengths[i]
        return AttentionKV(k=self.k[i], v=self.v[i], start=self.start, length=n, consumed=n, window=self.window,
                           trim=False)

    def settle(self, i: int, view: AttentionKV) -> None:
        self.lengths[i] = view.length

    def copy_branch(self, src: int, dsts: list[int]) -> None:
        for j in dsts:
            self.k[j].copy_(self.k[src])
            self.v[j].copy_(self.v[src])
            self.lengths[j] = self.lengths[src]

    def nbytes(self) -> int:
        return nbytes(self.k, self.v)


@dataclass
class BranchRecurrent:
    """Each branch's own copy of one Gated DeltaNet layer's constant-size state.

    Fields:
        recurrent: [G, Hv, Dk, Dv] (float32, float64 for float64 models).
        conv_tail: [G, C, K-1], the last K-1 pre-conv inputs (model dtype).
        positions: per branch, the position its state stands at (the next token's).
    """

    recurrent: torch.Tensor
    conv_tail: torch.Tensor
    positions: list = field(default_factory=list)

    @classmethod
    def from_snapshot(cls, snapshot, branches: int, position: int = 0) -> "BranchRecurrent":
        """G copies of a prompt snapshot (recurrent [Hv, Dk, Dv], conv_tail [C, K-1]) at `position`."""
        recurrent, tail = snapshot
        assert recurrent is not None and tail is not None, "decoding needs the prompt's recurrent snapshot"
        return cls(recurrent=recurrent.expand(branches, *recurrent.shape).clone(),
                   conv_tail=tail.expand(branches, *tail.shape).clone(), positions=[position] * branches)

    def state(self, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [B, Hv, Dk, Dv], conv_tail [B, C, K-1]) of `rows` (None: all)."""
        return pick(self.recurrent, rows), pick(self.conv_tail, rows)

    def update(self, recurrent: torch.Tensor, conv_tail: torch.Tensor, rows: list[int] | None = None) -> None:
        """The state of `rows` after one more token."""
        assert recurrent.shape[1:] == self.recurrent.shape[1:] and conv_tail.shape[1:] == self.conv_tail.shape[1:]
        put(self.recurrent, rows, recurrent)
        put(self.conv_tail, rows, conv_tail)
        for i in range(len(self.positions)) if rows is None else rows:
            self.positions[i] += 1

    def view(self, i: int) -> RecurrentState:
        """Branch i's state as a `RecurrentState` holding one snapshot (at its position)."""
        return RecurrentState(snapshots={self.positions[i]: (self.recurrent[i], self.conv_tail[i])})

    def settle(self, i: int, view: RecurrentState) -> None:
        (position, (recurrent, tail)), = view.snapshots.items()
        self.recurrent[i].copy_(recurrent)
        self.conv_tail[i].copy_(tail)
        self.positions[i] = position

    def copy_branch(self, src: int, dsts: list[int]) -> None:
        for j in dsts:
            self.recurrent[j].copy_(self.recurrent[src])
            self.conv_tail[j].copy_(self.conv_tail[src])
            self.positions[j] = self.positions[src]

    def nbytes(self) -> int:
        return nbytes(self.recurrent, self.conv_tail)


@dataclass
class BranchLatent(_Lengths):
    """Own MLA latent rows (and DSA indexer keys) of the G branches for one layer.

    Fields:
        rows: [G, capacity, R + Dr], the normalized latent followed by the RoPE'd rope key.
        index_keys: [G, capacity, Di] for a layer with its own indexer, else None.
        rank: R (the value is a view of a row's first R columns).
        start, lengths: as `BranchKV`.
    """

    rows: torch.Tensor
    index_keys: torch.Tensor | None
    start: int
    rank: int = 0
    lengths: list = field(default_factory=list)

    def __post_init__(self):
        if not self.lengths:
            self.lengths = [0] * self.rows.shape[0]

    @classmethod
    def empty(cls, *, branches: int, width: int, index_dim: int | None, capacity: int, start: int, dtype,
              device, rank: int = 0) -> "BranchLatent":
        rows = torch.empty(branches, capacity, width, dtype=dtype, device=device)
        index = None if index_dim is None else torch.empty(branches, capacity, index_dim, dtype=dtype, device=device)
        return cls(rows=rows, index_keys=index, start=start, rank=rank)

    @torch.no_grad()
    def append(self, row: torch.Tensor, index_key: torch.Tensor | None, rows: list[int] | None = None) -> None:
        """Write one token per branch of `rows` (None: all): row [B, R + Dr], index_key [B, Di] or None."""
        branch, at = (t.to(self.rows.device) for t in self.grow(rows, self.rows.shape[1]))
        self.rows[branch, at] = row.to(self.rows.dtype)  # each branch at its own row
        if self.index_keys is not None:
            self.index_keys[branch, at] = index_key.to(self.index_keys.dtype)

    def filled(self, rows: list[int] | None = None) -> torch.Tensor:
        """[B, n, R + Dr] of `rows` (None: all), n the longest branch's filled rows (mask a
        shorter branch's by `lengths_of`)."""
        return pick(self.rows[:, : self.longest(rows)], rows)

    def filled_index_keys(self, rows: list[int] | None = None) -> torch.Tensor:
        """[B, n, Di] of the indexer keys of `rows` (None: all), as `filled`."""
        return pick(self.index_keys[:, : self.longest(rows)], rows)

    def view(self, i: int) -> MLAState:
        """Branch i's rows as an `MLAState` (aliasing them: appends write in place)."""
        n = self.lengths[i]
        k = self.rows[i][None]  # (1, capacity, R + Dr)
        latent = LatentKV(k=k, v=k[..., : self.rank], start=self.start, length=n, consumed=n, trim=False)
        index = None if self.index_keys is None else IndexKeys(keys=self.index_keys[i], start=self.start, length=n,
                                                               consumed=n)
        return MLAState(latent=latent, index=index)

    def settle(self, i: int, view: MLAState) -> None:
        self.lengths[i] = view.latent.length

    def copy_branch(self, src: int, dsts: list[int]) -> None:
        for j in dsts:
            self.rows[j].copy_(self.rows[src])
            if self.index_keys is not None:
                self.index_keys[j].copy_(self.index_keys[src])
            self.lengths[j] = self.lengths[src]

    def nbytes(self) -> int:
        return nbytes(self.rows, self.index_keys)


@dataclass
class BranchState:
    """All layers' per-branch state (None: a layer with nothing of its own).

    Fields:
        layers: indexed by layer index.
        branches: G. start: absolute position of every branch's first token (P - 1).
    """

    layers: list = field(default_factory=list)
    branches: int = 1
    start: int = 0

    def view(self, i: int, rope_length: int | None = None) -> PromptState:
        """Branch i's own state as a `PromptState` to stack after the prompt's: a capture
        run against [prompt, view] absorbs a chunk into branch i (then call `settle`)."""
        layers = [None if s is None else s.view(i) for s in self.layers]
        return PromptState(layers=layers, start=self.start, rope_length=rope_length)

    def settle(self, i: int, view: PromptState) -> None:
        """Record what a capture against `view` (from `view(i)`) appended to branch i."""
        for s, v in zip(self.layers, view.layers):
            if s is not None:
                s.settle(i, v)

    def copy_branch(self, src: int, dsts: list[int]) -> None:
        """Branches `dsts` take branch `src`'s state (a shared prefix absorbed once)."""
        for s in self.layers:
            if s is not None:
                s.copy_branch(src, dsts)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers if s is not None)
