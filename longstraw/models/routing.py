"""How a run reaches a Hugging Face model's own modules: the phase of the run, the call
its layers read, and the switch that routes them.

Every supported family computes q/k/v (projections, q/k norms, RoPE, output gates)
inside its own attention module and then calls the function registered in
`transformers`' `ALL_ATTENTION_FUNCTIONS` under `config._attn_implementation`. We
register one function, "longstraw" (`attention.py`), and switch a model to it only
inside `routed(...)`. Families whose mixers need more than an attention function (GDN,
MLA) replace those modules' `forward` on the instance, inside `forwards_replaced(...)`.
The model's own modules therefore do all the projections, and LoRA / PEFT wrappers on
them keep working untouched.

Inside, the current `AttentionCall` names the stacked states to attend to (the prompt
state; for a branch replayed in pieces, also the state of its earlier pieces) and what
to do with the new tokens' state in the last of them, by `Phase`:

    CAPTURE    append it (under no_grad)
    REPLAY     only read; where a state has gradient buffers, backward adds
               dLoss/dState into them
    RECOMPUTE  reverse walk: attend to what lies before `start`, and record (new state
               with graph, a reader of its accumulated gradient) as seeds of the last
               state; a capture run with autograd on records them too (a kept graph).
               Divided (`call.divided`, a `DividedChunk`): the tokens are this rank's
               own positions of the chunk
    DECODE     a rollout step: G branches, one token each at position `start`; their
               state goes into the per-branch `call.branches`, and the shared prompt
               state is only read
    DIVIDED    context parallelism's divided capture: the tokens are this rank's own
               positions (`call.positions`, a `Divided`), the whole prompt in one call

Each family's mixer takes the one switch `AttentionCall.route` over these: decode,
divided capture, divided reverse walk, or a run of consecutive positions (capture,
replay, recompute). The round-robin deal of positions over ranks is
`longstraw.parallel.deal.Deal`; `Divided` and `DividedChunk` only apply it.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from dataclasses import dataclass, field

import torch

from longstraw.parallel.collectives import GatherRows, SumGradAcrossRanks
from longstraw.parallel.deal import Deal
from longstraw.state.branch import BranchState
from longstraw.state.prompt import PromptState

IMPLEMENTATION = "longstraw"
"""The name LongStraw's attention function is registered under (`attention.py`)."""


class Phase(str, enum.Enum):
    """What a run does with the new tokens' state (see the module docstring). A str
    enum: `Phase("capture")` converts, and a phase equals its name as a string."""

    CAPTURE = "capture"
    REPLAY = "replay"
    RECOMPUTE = "recompute"
    DECODE = "decode"
    DIVIDED = "divided"


# ----------------------------------------------------------------------------
# context parallelism: what a divided layer needs to know


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


# ----------------------------------------------------------------------------
# the call


@dataclass
class AttentionCall:
    """What the routed layers need to know about the tokens being run.

    Fields:
        states: stacked states, earliest first; `states[i].layers[layer_idx]` is the
            layer's state. Capture and recompute act on the last one.
        start: absolute position of the first token of this call.
        phase: a `Phase` (see the module docstring).
        block_size: prefix positions per attention block.
        branches: phase DECODE only: the G branches' own state.
        positions: the tokens' absolute positions [T] when they are not start.. (phase
            DIVIDED: this rank's own positions).
        divided: phase DIVIDED: a `Divided`; phase RECOMPUTE of a divided reverse walk: a
            `DividedChunk`; None otherwise.
    """

    states: list[PromptState]
    start: int
    phase: Phase
    block_size: int
    branches: BranchState | None = None
    positions: torch.Tensor | None = None
    divided: Divided | DividedChunk | None = None

    def records_roots(self) -> bool:
        """Whether the chunk's own state tensors are recorded as roots of its graph
        (`PromptState.seeds`): in a recompute, and in a capture that keeps its graph
        (run with autograd on)."""
        return self.phase is Phase.RECOMPUTE or (self.phase is Phase.CAPTURE and torch.is_grad_enabled())

    def route(self, *, chunk, decode, divided, divided_walk):
        """The one switch over phases every mixer takes; returns the handler for this call:
        `decode` (DECODE), `divided` (DIVIDED: a divided capture), `divided_walk` (RECOMPUTE
        of a divided reverse walk, `divided` a `DividedChunk`), else `chunk` (CAPTURE,
        REPLAY or RECOMPUTE of consecutive positions from `start`)."""
        if self.phase is Phase.DECODE:
            return decode
        if self.phase is Phase.DIVIDED:
            return divided
        if self.phase is Phase.RECOMPUTE and self.divided is not None:
            return divided_walk
        return chunk


_CURRENT: contextvars.ContextVar[AttentionCall | None] = contextvars.ContextVar("longstraw_attention", default=None)


def current_call() -> AttentionCall:
    """The `AttentionCall` of the run in progress."""
    call = _CURRENT.get()
    if call is None:
        raise RuntimeError("a longstraw-routed layer was called outside an Engine run")
    return call


# ----------------------------------------------------------------------------
# routing the model's own modules


@contextlib.contextmanager
def forwards_replaced(modules, forwards):
    """Within the block, module i runs forwards[i] instead of its own `forward` (set on
    the instance only, and restored after, so the model is untouched outside)."""
    saved = [(m, m.__dict__.get("forward")) for m in modules]
    for m, forward in zip(modules, forwards):
        m.forward = forward
    try:
        yield
    finally:
        for m, previous in saved:
            if previous is None:
                del m.forward
            else:
                m.forward = previous


@contextlib.contextmanager
def routed(config, call: AttentionCall):
    """Within the block, `config`'s model attends through LongStraw with `call`."""
    previous = config._attn_implementation_internal
    token = _CURRENT.set(call)
    config._attn_implementation_internal = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation_internal = previous
        _CURRENT.reset(token)


def run_backbone(backbone, config, input_ids: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """Run the model's own decoder stack.

    One sequence: input_ids [T] at positions start.. -> hidden [T, d].
    Phase DECODE: input_ids [G], one token per branch, all at position start -> hidden [G, d].
    """
    decode = call.phase is Phase.DECODE
    if decode:
        ids = input_ids[:, None]  # (G, 1): a batch of G one-token sequences
        positions = torch.full_like(ids, call.start)
    elif call.positions is not None:
        ids, positions = input_ids[None], call.positions[None]  # (1, T)
    else:
        ids = input_ids[None]  # (1, T)
        positions = torch.arange(call.start, call.start + input_ids.shape[0], device=input_ids.device)[None]
    with routed(config, call):
        out = backbone(input_ids=ids, position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state
    return hidden[:, 0] if decode else hidden[0]
