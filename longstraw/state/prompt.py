"""Per-layer prompt state: what capture keeps so later tokens can attend to the prompt.

Shapes (one prompt, no batch dim):
    Hkv  key/value heads (never expanded by the GQA group)
    S    positions held by the state
    D    head dim (Dv for values)

Each class is small and named, with `nbytes()` and shape checks at the boundary, so
no bare tuple of tensors travels through the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.host import on_host
from longstraw.parallel.deal import Deal
from longstraw.state.recurrent import RecurrentState  # noqa: F401  (one of the state kinds, public here)
from longstraw.tensors import KVSegment, accumulation_dtype, nbytes

HOST = "host"
"""The `device` for per-token rows in host memory (state offload, `offload.py`): they
are allocated as placeholders on the meta device (no memory), which the state's
`offload.Stager` then replaces with views of one host arena (`host_arena.py`), pinned
when CUDA is available (so copies can overlap)."""


def empty_rows(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised tensor of `shape` on `device`, or a meta placeholder for `HOST`."""
    return torch.empty(*shape, dtype=dtype, device="meta" if device == HOST else device)


def zeros_like_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros shaped like `t` in `dtype`, on its device (an offloaded state's host gradient
    rows come from its stager's arena instead: `PromptState.enable_grad_buffers`)."""
    return torch.zeros(t.shape, dtype=dtype, device=t.device)


@dataclass(frozen=True)
class Shard:
    """Which prompt positions a context-parallel rank holds: rank `rank`'s share of the
    round-robin deal (`parallel.deal.Deal`: blocks of `block` positions, block b on rank
    b % world, so causal work is balanced across ranks). The arithmetic is the deal's."""

    rank: int
    world: int
    block: int
    cp: object = field(default=None, compare=False)
    """the `parallel.context.ContextParallel` the shard belongs to"""
    deal: Deal = field(init=False, repr=False, compare=False)
    """the deal (world, block) this rank holds a share of"""

    def __post_init__(self):
        object.__setattr__(self, "deal", Deal(self.world, self.block))

    def count(self, n):
        """Positions this rank owns in [0, n): an int, or elementwise for a LongTensor n."""
        return self.deal.count(n, self.rank)

    def held(self, start: int, end: int) -> int:
        """Positions this rank owns in [start, end)."""
        return self.count(end) - self.count(start)

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool mask: which of these absolute positions (LongTensor) are ours."""
        return self.deal.owner(positions) == self.rank

    def owned(self, start: int, end: int) -> torch.Tensor:
        """Bool [end - start]: which of the absolute positions start..end-1 are ours."""
        return self.owns(torch.arange(start, end))

    def own_offsets(self, start: int, end: int) -> torch.Tensor:
        """LongTensor [held(start, end)] on the host: the offsets from `start` of the
        positions of [start, end) this rank owns, increasing. Arithmetic of the deal, on
        real host tensors even inside a rehearsal (`longstraw.host.on_host`): indexing by it
        needs no `nonzero` on the device (a sync on CUDA, no shape at all on fake tensors)."""
        with on_host():
            first = self.count(start)
            rows = torch.arange(first, first + self.held(start, end))
            return self.deal.position(rows, self.rank) - start


def rows_held_before(position: int, *, start: int, length: int, shard: Shard | None) -> int:
    """Rows a state that holds `length` rows from absolute position `start` on (all of
    them, or `shard`'s only) holds for the positions before `position`."""
    n = position - start if shard is None else shard.held(start, position)
    return max(0, min(length, n))


@dataclass
class AttentionKV:
    """K and V of one attention layer, after RoPE and any k-norm.

    Full attention keeps every prompt position; a sliding-window layer keeps only the
    last `window - 1` positions (all that any later query can see).

    Fields:
        k: [Hkv, capacity, D]
        v: [Hkv, capacity, Dv]
        start: absolute position of index 0.
        length: positions filled (index `length` is the next to write).
        window: sliding window W of the layer, or None for full attention.
        trim: drop positions no later query can see (windowed layers, detached mode).
            Exact mode keeps them: the reverse walk recomputes every chunk.
        k_grad, v_grad: exact mode only: dLoss/dk, dLoss/dv, same shapes as k, v, in
            float32 (float64 for a float64 state) whatever the model dtype,
            summed over branches and later chunks.
        shard: context parallelism: hold only this rank's positions (rows in position
            order); None holds every position.
        consumed: positions consumed since `start`, held or not.
    """

    k: torch.Tensor
    v: torch.Tensor
    start: int = 0
    length: int = 0
    window: int | None = None
    trim: bool = True
    k_grad: torch.Tensor | None = None
    v_grad: torch.Tensor | None = None
    shard: Shard | None = None
    consumed: int = 0

    @classmethod
    def empty(cls, *, kv_heads: int, head_dim: int, v_head_dim: int, capacity: int, start: int = 0,
              window: int | None, dtype: torch.dtype, device, trim: bool = True,
              shard: Shard | None = None) -> "AttentionKV":
        """Allocate the state for `capacity` prompt positions (full), this rank's share
        of them (sharded), or none yet (trimmed window)."""
        trim = trim and window is not None
        if shard is not None:  # a sharded window is filled once, then trimmed (`append_own`)
            capacity = shard.held(start, start + capacity)
        elif trim:
            capacity = 0  # grows by chunk, trimmed to window - 1 after each append
        k = empty_rows(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        v = empty_rows(kv_heads, capacity, v_head_dim, dtype=dtype, device=device)
        return cls(k=k, v=v, start=start, window=window, trim=trim, shard=shard)

    @property
    def end(self) -> int:
        """Absolute position one past the last one consumed."""
        return self.start + self.consumed

    def rows_before(self, position: int) -> int:
        """Rows held for absolute positions before `position`."""
        return rows_held_before(position, start=self.start, length=self.length, shard=self.shard)

    def keys(self, until: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only views (k [Hkv, n, D], v [Hkv, n, Dv]) of the positions held
        before absolute position `until` (default: all filled positions)."""
        n = self.length if until is None else self.rows_before(until)
        return self.k[:, :n], self.v[:, :n]

    def segment(self, until: int | None = None) -> KVSegment:
        """The held positions before `until` as a `KVSegment` (with its gradient
        buffers when they exist), for the attention op to read."""
        k, v = self.keys(until)
        n = k.shape[1]
        grad = None if self.k_grad is None else (self.k_grad[:, :n], self.v_grad[:, :n])
        if self.shard is None:
            return KVSegment(k, v, self.start, grad)
        positions = self.row_positions(n) if self.window is not None else None  # the window masks by position
        return KVSegment(k, v, self.start, grad, cp=self.shard.cp, positions=positions)

    def row_positions(self, n: int) -> torch.Tensor:
        """Absolute positions [n] of a sharded state's first n rows (this rank's positions
        from `start` on, increasing)."""
        first = self.shard.count(self.start)  # rows this rank owns before `start`
        rows = torch.arange(first, first + n, device=self.k.device)
        return self.shard.deal.position(rows, self.shard.rank)

    def chunk_grads(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(dk [Hkv, T, D], dv [Hkv, T, Dv]) accumulated for absolute positions
        [start, end): the seeds of a chunk. Sharded: this rank's rows, zeros elsewhere
        (the caller sums over ranks)."""
        a, b = self.rows_before(start), self.rows_before(end)
        if self.shard is None:
            return self.k_grad[:, a:b].clone(), self.v_grad[:, a:b].clone()
        mine = self.shard.own_offsets(start, end).to(self.k.device)
        dk = self.k_grad.new_zeros(self.k_grad.shape[0], end - start, self.k_grad.shape[2])
        dv = self.v_grad.new_zeros(self.v_grad.shape[0], end - start, self.v_grad.shape[2])
        dk[:, mine] = self.k_grad[:, a:b]
        dv[:, mine] = self.v_grad[:, a:b]
        return dk, dv

    def own_grads(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(dk [Hkv, n, D], dv [Hkv, n, Dv]) accumulated for the n positions of [start, end)
        this rank holds, in position order (a copy): the seeds of a chunk in a divided
        reverse walk, which recomputes only these positions here."""
        a, b = self.rows_before(start), self.rows_before(end)
        return self.k_grad[:, a:b].clone(), self.v_grad[:, a:b].clone()

    def enable_grad_buffers(self) -> None:
        """Allocate zeroed dLoss/dk, dLoss/dv buffers for every position the state holds
        or will hold (exact mode's prompt state, also before capture when capture keeps
        chunk graphs; the earlier pieces of a branch replayed in pieces)."""
        acc = accumulation_dtype(self.k.dtype)  # summed over branches and chunks: never in bf16/fp16
        self.k_grad = zeros_like_rows(self.k, acc)
        self.v_grad = zeros_like_rows(self.v, acc)

    def release_grad_buffers(self) -> None:
        """Drop the dLoss/dk, dLoss/dv buffers (a step's walk has spent them)."""
        self.k_grad = self.v_grad = None

    @torch.no_grad()
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the next positions. k_new: [Hkv, T, D], v_new: [Hkv, T, Dv]."""
        assert k_new.shape[0] == self.k.shape[0] and k_new.shape[2] == self.k.shape[2], (k_new.shape, self.k.shape)
        assert v_new.shape[:2] == k_new.shape[:2] and v_new.shape[2] == self.v.shape[2], (v_new.shape, self.v.shape)
        t = k_new.shape[1]
        if self.shard is not None or not self.trim:
            if self.shard is not None:
                mine = self.shard.own_offsets(self.end, self.end + t).to(k_new.device)
                k_new, v_new = k_new[:, mine], v_new[:, mine]
            if self.trim:  # a sharded window: grows by chunk, then trimmed
                self.k = torch.cat([self.k[:, :self.length], k_new.to(self.k.dtype)], dim=1)
                self.v = torch.cat([self.v[:, :self.length], v_new.to(self.v.dtype)], dim=1)
                self.length = self.k.shape[1]
            else:
                self._write(k_new, v_new)
            self.consumed += t
            self._trim_shard()
            return
        keep = self.window - 1
        k = torch.cat([self.k[:, : self.length], k_new.to(self.k.dtype)], dim=1)
        v = torch.cat([self.v[:, : self.length], v_new.to(self.v.dtype)], dim=1)
        drop = max(0, k.shape[1] - keep)
        self.k, self.v = k[:, drop:].clone(), v[:, drop:].clone()
        self.start += drop
        self.length = self.consumed = self.k.shape[1]

    @torch.no_grad()
    def append_own(self, k_rows: torch.Tensor, v_rows: torch.Tensor, consumed: int) -> None:
        """Context parallelism's divided capture: write this rank's rows (k_rows [Hkv, n, D],
        v_rows [Hkv, n, Dv]) of the next `consumed` positions, computed here."""
        assert self.shard is not None and self.length == 0, "a sharded state, filled once"
        self._write(k_rows, v_rows)
        self.consumed += consumed
        self._trim_shard()

    def _trim_shard(self) -> None:
        """A sharded sliding window (detached mode): keep only this rank's rows of the
        last window - 1 positions (its capacity was this rank's share of them all)."""
        if self.shard is None or not self.trim:
            return
        start = max(self.start, self.end - (self.window - 1))
        drop = self.shard.held(self.start, start)
        self.k, self.v = self.k[:, drop:self.length].clone(), self.v[:, drop:self.length].clone()
        self.start, self.length, self.consumed = start, self.length - drop, self.end - start

    def _write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        n = k_new.shape[1]
        assert self.length + n <= self.k.shape[1], "AttentionKV overflow: more positions than allocated"
        self.k[:, self.length : self.length + n] = k_new
        self.v[:, self.length : self.length + n] = v_new
        self.length += n

    def nbytes(self) -> int:
        """Bytes of K/V held (filled part for trimmed windowed layers, full capacity otherwise)."""
        return nbytes(self.k, self.v)

    def grad_nbytes(self) -> int:
        """Bytes of the exact-mode gradient buffers (0 in detached mode)."""
        return nbytes(self.k_grad, self.v_grad)


@dataclass
class PromptState:
    """The whole captured prompt state: one entry per decoder layer (None: no state).

    Fields:
        layers: per-layer state objects, indexed by layer index.
        start: absolute position of its first token (0 for the prompt; P - 1 for
            the earlier pieces of a branch replayed in pieces).
        length: positions captured so far (P - 1 for a full prompt).
        seeds: exact mode's reverse walk: the roots recorded while a chunk runs with
            autograd, each (tensors with graph, a function returning their accumulated
            gradients, None where there is none), read when the chunk is walked.
        kept: chunk start -> its roots, for the chunks whose capture graph was kept
            (`ExecConfig.keep_graph_bytes`): the reverse walk backpropagates through
            them instead of recomputing those chunks.
        origin: what the state was captured from (engine, prompt, weights), set by
            `Engine.capture` so that reusing it can be checked (`rollout.StateOrigin`).
        offload: state offload (`ExecConfig.state_device="cpu"`): the `offload.Stager`
            that stages the per-token rows, held in host memory, to the compute device
            one layer at a time; None: every row lives on the compute device.
        rope_length: the sequence length whose RoPE frequencies every call against this
            state uses, for RoPE types that pick them from the length ("dynamic",
            "longrope": `models/rope.py`); set by `Engine.capture`. None: each call's own.
        inputs: a prompt with images: its `state.vision.PromptImages` (the tower's
            embeddings and the M-RoPE positions every run against the state reads); None
            for a text prompt.
        outputs: exact mode with `ExecConfig.keep_attention_outputs`: the attention
            outputs and LSEs capture computed (`kept_outputs.KeptOutputs`), which the
            reverse walk's attention backward reads instead of attending again; None: the
            walk recomputes attention. Not part of `nbytes()`.
    """

    layers: list = field(default_factory=list)
    start: int = 0
    length: int = 0
    seeds: list = field(default_factory=list)
    kept: dict = field(default_factory=dict)
    origin: object = None
    offload: object = None
    rope_length: int | None = None
    inputs: object = None
    outputs: object = None

    def _parts(self) -> list:
        return [s for s in self.layers if s is not None] + ([self.inputs] if self.inputs is not None else [])

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._parts())

    def grad_nbytes(self) -> int:
        return sum(s.grad_nbytes() for s in self._parts())

    def enable_grad_buffers(self) -> None:
        """Zeroed dLoss/dState buffers for every layer (an offloaded state's host rows:
        one arena, `offload.Stager.enable_grad_buffers`)."""
        if self.inputs is not None:
            self.inputs.enable_grad_buffers()
        if self.offload is not None:
            self.offload.enable_grad_buffers()
            return
        for s in self.layers:
            if s is not None:
                s.enable_grad_buffers()

    def release_grad_buffers(self) -> None:
        """Drop every layer's state-gradient buffers: `Engine.step` calls it once its
        reverse walk has spent them (exact mode), so a held state keeps only its rows
        (`grad_nbytes() == 0`); stepping it again allocates them afresh."""
        for s in self._parts():
            s.release_grad_buffers()
        if self.offload is not None:
            self.offload.release_grad_buffers()


class LatentKV(AttentionKV):
    """One MLA layer's prompt state: per position the normalized compressed latent
    [kv_lora_rank] followed by the RoPE'd shared rope key [rope_dim], as ONE row, never
    expanded per head. Absorbed MLA reads it as a single-head (MQA) key [1, S, R + Dr]
    whose value is a view of the same rows' first R columns; gradient buffers share
    memory the same way, so the key and value gradients of a latent add up in place.
    """

    @classmethod
    def empty_latent(cls, *, rank: int, rope_dim: int, capacity: int, start: int = 0, dtype, device,
                     shard: Shard | None = None) -> "LatentKV":
        if shard is not None:
            capacity = shard.held(start, start + capacity)
        k = empty_rows(1, capacity, rank + rope_dim, dtype=dtype, device=device)
        return cls(k=k, v=k[..., :rank], start=start, trim=False, shard=shard)

    def _write(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write the next rows [1, n, R + Dr]; the value is a view of their first R columns."""
        n = k_new.shape[1]
        assert self.length + n <= self.k.shape[1], "LatentKV overflow: more positions than allocated"
        self.k[:, self.length : self.length + n] = k_new
        self.length += n

    def enable_grad_buffers(self) -> None:
        self.k_grad = zeros_like_rows(self.k, accumulation_dtype(self.k.dtype))
        self.v_grad = self.k_grad[..., : self.v.shape[-1]]

    def nbytes(self) -> int:
        return nbytes(self.k)

    def grad_nbytes(self) -> int:
        return nbytes(self.k_grad)


@dataclass
class IndexKeys:
    """One DSA indexer's keys for the prompt, [capacity, index_head_dim] (model dtype).
    The indexer runs without grad (as in HF), so these never get a gradient.

    Fields:
        keys: [capacity, Di]; start: absolute position of row 0; length: rows filled.
        shard: context parallelism: hold only this rank's positions (as `AttentionKV`).
        consumed: positions consumed since `start`, held or not.
    """

    keys: torch.Tensor
    start: int = 0
    length: int = 0
    shard: Shard | None = None
    consumed: int = 0

    @classmethod
    def empty(cls, *, capacity: int, dim: int, start: int = 0, dtype, device, shard: Shard | None = None):
        if shard is not None:
            capacity = shard.held(start, start + capacity)
        return cls(keys=empty_rows(capacity, dim, dtype=dtype, device=device), start=start, shard=shard)

    @property
    def end(self) -> int:
        return self.start + self.consumed

    def rows_before(self, position: int) -> int:
        """Rows held for absolute positions before `position`."""
        return rows_held_before(position, start=self.start, length=self.length, shard=self.shard)

    def until(self, position: int) -> torch.Tensor:
        """Rows held before absolute `position`: [n, Di]."""
        return self.keys[: self.rows_before(position)]

    def positions(self, until: int) -> torch.Tensor:
        """Absolute positions [n] of the rows `until(until)` returns, increasing."""
        n = self.rows_before(until)
        if self.shard is None:
            return torch.arange(self.start, self.start + n, device=self.keys.device)
        first = self.shard.count(self.start)  # rows this rank owns before `start`
        return self.shard.deal.position(torch.arange(first, first + n, device=self.keys.device), self.shard.rank)

    @torch.no_grad()
    def append(self, keys: torch.Tensor) -> None:
        t = keys.shape[0]
        if self.shard is not None:
            keys = keys[self.shard.own_offsets(self.end, self.end + t).to(keys.device)]
        self._write(keys)
        self.consumed += t

    @torch.no_grad()
    def append_own(self, keys: torch.Tensor, consumed: int) -> None:
        """Context parallelism's divided capture: write this rank's rows (keys [n, Di]) of
        the next `consumed` positions, computed here."""
        assert self.shard is not None and self.length == 0, "a sharded state, filled once"
        self._write(keys)
        self.consumed += consumed

    def _write(self, keys: torch.Tensor) -> None:
        n = keys.shape[0]
        assert self.length + n <= self.keys.shape[0], "IndexKeys overflow"
        self.keys[self.length : self.length + n] = keys
        self.length += n

    def nbytes(self) -> int:
        return nbytes(self.keys)

    def grad_nbytes(self) -> int:
        return 0

    def enable_grad_buffers(self) -> None:
        """Indexer keys take no gradient."""

    def release_grad_buffers(self) -> None:
        """Indexer keys take no gradient."""


@dataclass
class MLAState:
    """An MLA(+DSA) layer: its latent rows, and its indexer keys if it runs an indexer."""

    latent: LatentKV
    index: IndexKeys | None = None

    def nbytes(self) -> int:
        return self.latent.nbytes() + (self.index.nbytes() if self.index is not None else 0)

    def grad_nbytes(self) -> int:
        return self.latent.grad_nbytes()

    def enable_grad_buffers(self) -> None:
        self.latent.enable_grad_buffers()

    def release_grad_buffers(self) -> None:
        self.latent.release_grad_buffers()
