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
    DECODE     a rollout step: G branches (or the subset `call.rows`), one token each
               at position `start`; their
               state goes into the per-branch `call.branches`, and the shared prompt
               state is only read
    DIVIDED    context parallelism's divided capture: the tokens are this rank's own
               positions (`call.positions`, a `Divided`), the whole prompt in one call

Each family's mixer takes the one switch `AttentionCall.route` over these: decode,
divided capture, divided reverse walk, or a run of consecutive positions (capture,
replay, recompute). The round-robin deal of positions over ranks is
`longstraw.parallel.deal.Deal`; `Divided` and `DividedChunk` (`parallel/chunks.py`) only
apply it. `Phase` lives in `longstraw/phase.py` (below every layer; the CP driver passes it too).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from longstraw.heartbeat import beat
from longstraw.parallel.chunks import Divided, DividedChunk
from longstraw.phase import Phase
from longstraw.state.branch import BranchState
from longstraw.state.prompt import PromptState

IMPLEMENTATION = "longstraw"
"""The name LongStraw's attention function is registered under (`attention.py`)."""


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
        rows: phase DECODE only: the branches run, by index (None: all G, in order).
        positions: the tokens' absolute positions [T] when they are not start.. (phase
            DIVIDED: this rank's own positions; phase DECODE: each branch's [B], when
            they do not all stand at `start`).
        divided: phase DIVIDED: a `Divided`; phase RECOMPUTE of a divided reverse walk: a
            `DividedChunk`; None otherwise.
        recomputing: the run is a layer's recompute inside backward (`recompute.py`):
            it records no roots (the first forward did).
    """

    states: list[PromptState]
    start: int
    phase: Phase
    block_size: int
    branches: BranchState | None = None
    rows: list[int] | None = None
    positions: torch.Tensor | None = None
    divided: Divided | DividedChunk | None = None
    recomputing: bool = False

    def decode_positions(self):
        """Phase DECODE: the branches' query positions, an int when all stand at `start`,
        else a LongTensor [B]."""
        return self.start if self.positions is None else self.positions

    def records_roots(self) -> bool:
        """Whether the chunk's own state tensors are recorded as roots of its graph
        (`PromptState.seeds`): in a recompute, and in a capture that keeps its graph
        (run with autograd on); never in a layer's recompute inside backward."""
        if self.recomputing:
            return False
        return self.phase is Phase.RECOMPUTE or (self.phase is Phase.CAPTURE and torch.is_grad_enabled())

    def divides_tokens(self) -> bool:
        """Whether each rank runs only its own rows (a divided capture or reverse walk),
        rather than the same tokens as every other rank."""
        return self.phase is Phase.DIVIDED or (self.phase is Phase.RECOMPUTE and self.divided is not None)

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


def active_call() -> AttentionCall | None:
    """The `AttentionCall` of the run in progress, or None outside an Engine run."""
    return _CURRENT.get()


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
    Phase DECODE: input_ids [G], one token per branch, at position start (or each at
    call.positions [G]) -> hidden [G, d].
    Phase REPLAY, a batch of branches (batched replay): input_ids [B, T], each at
    positions start.. -> hidden [B, T, d].
    """
    decode = call.phase is Phase.DECODE
    batched = input_ids.dim() == 2 and not decode
    assert not batched or (call.phase is Phase.REPLAY and call.positions is None), "a batch is replay's"
    if batched:
        ids = input_ids  # (B, T): B sequences at the same positions
        positions = torch.arange(call.start, call.start + ids.shape[1], device=ids.device)[None].expand_as(ids)
    elif decode:
        ids = input_ids[:, None]  # (G, 1): a batch of G one-token sequences
        positions = torch.full_like(ids, call.start) if call.positions is None else call.positions[:, None]
    elif call.positions is not None:
        ids, positions = input_ids[None], call.positions[None]  # (1, T)
    else:
        ids = input_ids[None]  # (1, T)
        positions = torch.arange(call.start, call.start + input_ids.shape[0], device=input_ids.device)[None]
    images = call.states[0].inputs if call.states else None  # a prompt with images (`state/vision.py`)
    with routed(config, call):
        if images is None:
            out = backbone(input_ids=ids, position_ids=positions, use_cache=False)
        else:  # the tower's rows at image tokens, HF's M-RoPE ids: both looked up by sequence index
            out = backbone(inputs_embeds=images.embed(backbone.get_input_embeddings(), ids, positions),
                           position_ids=images.rope_positions(positions), use_cache=False)
    hidden = out.last_hidden_state
    beat()  # every layer ran (their FSDP2 all-gathers completed): progress for the launch watchdog
    return hidden[:, 0] if decode else (hidden if batched else hidden[0])
