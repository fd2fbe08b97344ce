"""Per-branch decode state: what each of the G rollout branches keeps of its OWN tokens.

The prompt state (`prompt.py`) is shared by every branch and only read while decoding.
Each branch adds only what its generated tokens need, allocated once for
`capacity` = max_new_tokens positions:

    attention layer   BranchKV      k [G, Hkv, capacity, D], v [G, Hkv, capacity, Dv]
    Gated DeltaNet    BranchRecurrent  recurrent [G, Hv, Dk, Dv] (fp32) + conv tail
                                    [G, C, K-1]: one copy of the constant-size state each
    MLA (+ DSA)       BranchLatent  latent rows [G, capacity, R + Dr] (+ indexer keys
                                    [G, capacity, Di])

Every branch's row j is the token at absolute position `start + j` (start = P - 1, the
position of the prompt's last token, which every branch feeds first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.tensors import nbytes


@dataclass
class BranchKV:
    """Own K/V of the G branches for one attention layer.

    Fields:
        k: [G, Hkv, capacity, D]; v: [G, Hkv, capacity, Dv].
        start: absolute position of row 0. length: rows filled (the same for every branch).
        window: the layer's sliding window (None: full attention).
    """

    k: torch.Tensor
    v: torch.Tensor
    start: int
    length: int = 0
    window: int | None = None

    @classmethod
    def empty(cls, *, branches: int, kv_heads: int, head_dim: int, v_head_dim: int, capacity: int, start: int,
              window: int | None, dtype, device) -> "BranchKV":
        k = torch.empty(branches, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        v = torch.empty(branches, kv_heads, capacity, v_head_dim, dtype=dtype, device=device)
        return cls(k=k, v=v, start=start, window=window)

    @torch.no_grad()
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write one token per branch: k_new [G, Hkv, 1, D], v_new [G, Hkv, 1, Dv]."""
        assert k_new.shape[0] == self.k.shape[0] and k_new.shape[2] == 1, (k_new.shape, self.k.shape)
        assert self.length < self.k.shape[2], "BranchKV overflow: more tokens than max_new_tokens"
        self.k[:, :, self.length] = k_new[:, :, 0]
        self.v[:, :, self.length] = v_new[:, :, 0]
        self.length += 1

    def keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (k [G, Hkv, n, D], v [G, Hkv, n, Dv]) of the filled rows."""
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def nbytes(self) -> int:
        return nbytes(self.k, self.v)


@dataclass
class BranchRecurrent:
    """Each branch's own copy of one Gated DeltaNet layer's constant-size state.

    Fields:
        recurrent: [G, Hv, Dk, Dv] (float32, float64 for float64 models).
        conv_tail: [G, C, K-1], the last K-1 pre-conv inputs (model dtype).
    """

    recurrent: torch.Tensor
    conv_tail: torch.Tensor

    @classmethod
    def from_snapshot(cls, snapshot, branches: int) -> "BranchRecurrent":
        """G copies of a prompt snapshot (recurrent [Hv, Dk, Dv], conv_tail [C, K-1])."""
        recurrent, tail = snapshot
        assert recurrent is not None and tail is not None, "decoding needs the prompt's recurrent snapshot"
        return cls(recurrent=recurrent.expand(branches, *recurrent.shape).clone(),
                   conv_tail=tail.expand(branches, *tail.shape).clone())

    def update(self, recurrent: torch.Tensor, conv_tail: torch.Tensor) -> None:
        assert recurrent.shape == self.recurrent.shape and conv_tail.shape == self.conv_tail.shape
        self.recurrent, self.conv_tail = recurrent, conv_tail

    def nbytes(self) -> int:
        return nbytes(self.recurrent, self.conv_tail)


@dataclass
class BranchLatent:
    """Own MLA latent rows (and DSA indexer keys) of the G branches for one layer.

    Fields:
        rows: [G, capacity, R + Dr], the normalized latent followed by the RoPE'd rope key.
        index_keys: [G, capacity, Di] for a layer with its own indexer, else None.
        start, length: as `BranchKV`.
    """

    rows: torch.Tensor
    index_keys: torch.Tensor | None
    start: int
    length: int = 0

    @classmethod
    def empty(cls, *, branches: int, width: int, index_dim: int | None, capacity: int, start: int, dtype,
              device) -> "BranchLatent":
        rows = torch.empty(branches, capacity, width, dtype=dtype, device=device)
        index = None if index_dim is None else torch.empty(branches, capacity, index_dim, dtype=dtype, device=device)
        return cls(rows=rows, index_keys=index, start=start)

    @torch.no_grad()
    def append(self, row: torch.Tensor, index_key: torch.Tensor | None) -> None:
        """Write one token per branch: row [G, R + Dr], index_key [G, Di] or None."""
        assert self.length < self.rows.shape[1], "BranchLatent overflow: more tokens than max_new_tokens"
        self.rows[:, self.length] = row
        if self.index_keys is not None:
            self.index_keys[:, self.length] = index_key
        self.length += 1

    def filled(self) -> torch.Tensor:
        """[G, n, R + Dr] view of the filled rows."""
        return self.rows[:, : self.length]

    def filled_index_keys(self) -> torch.Tensor:
        """[G, n, Di] view of the filled indexer keys."""
        return self.index_keys[:, : self.length]

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

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers if s is not None)
