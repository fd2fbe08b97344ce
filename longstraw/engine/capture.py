"""Capture: run prompt[:-1] ([P-1] tokens) in chunks under no_grad and keep the state
later tokens need; and, under context parallelism, this rank's deal of the prompt
positions and whether capture and exact mode's walk run divided over the ranks.

The functions take the `Engine`; `Engine.capture`, `divides_capture` and
`divides_walk` are its public faces."""

from __future__ import annotations

import contextlib

import torch

from longstraw.engine.clock import progress
from longstraw.engine.kept_graphs import SavedBytes, chunks_to_keep
from longstraw.engine.rollout import stamp_state
from longstraw.engine.inputs import check_inputs
from longstraw.parallel.divided import divided_capture
from longstraw.parallel.fsdp import fsdp_sum_factor
from longstraw.phase import Phase
from longstraw.state.kept_outputs import KeptOutputs
from longstraw.state.offload import Stager
from longstraw.state.prompt import PromptState, RecurrentState, Shard


def capture_chunks(engine, ids: torch.Tensor, start: int, states: list[PromptState], size: int,
                   desc: str | None, keep_graph_bytes: int = 0) -> None:
    """Run ids [T] at positions start.. in chunks of `size` under no_grad,
    appending their state to states[-1].

    With `keep_graph_bytes` > 0 (exact mode; states[-1] already has its gradient
    buffers), the first chunk runs with autograd and its graph is measured
    (`kept_graphs.SavedBytes`); the last chunks whose graphs fit the budget then run
    with autograd too, and their roots are kept in `states[-1].kept` for the walk. Not
    under FSDP2 (the walk recomputes every chunk there)."""
    starts = list(range(0, ids.shape[0], size))
    if engine.adapter.sharded_modules():  # FSDP2 frees a layer's weights after its forward: a kept graph's saved
        keep_graph_bytes = 0  # weights would be gone by the walk; the walk recomputes the chunk (parallel.fsdp)
    keep: set[int] = set()
    for a in progress(starts, enabled=engine.config.progress, desc=desc, total=len(starts)):
        piece = ids[a : a + size]
        measure = keep_graph_bytes > 0 and a == 0
        saved = SavedBytes(engine.model) if measure else contextlib.nullcontext()
        with torch.set_grad_enabled(measure or a in keep), saved:
            states[-1].seeds = []
            engine.adapter.run(piece, start + a, states, phase=Phase.CAPTURE, block_size=engine.config.attention_block_size)
        if measure:
            keep = chunks_to_keep(starts, saved.total, keep_graph_bytes)
        if a in keep:
            states[-1].kept[start + a] = states[-1].seeds
        states[-1].seeds = []
        states[-1].length += piece.shape[0]


def capture(engine, prompt: torch.Tensor, *, exact: bool = False, keep_graph_bytes: int = 0,
            rope_length: int | None = None, prompt_inputs: dict | None = None,
            keep_attention_outputs: bool = False) -> PromptState:
    """The prompt state of prompt [P] (see `Engine.capture`)."""
    check_inputs(engine, prompt, prompt_inputs)
    ids = prompt[:-1].to(engine.adapter.device)  # (P-1,)
    shard = rank_shard(engine)
    offload = engine.config.offloads_state()
    state = engine.adapter.new_state(ids.shape[0], exact=exact, shard=shard, host=offload)
    state.inputs = engine.adapter.encode_inputs(prompt, prompt_inputs, engine.cp)  # the tower, once (models/vision.py)
    state.rope_length = int(prompt.numel()) if rope_length is None else rope_length
    if offload:  # per-token rows in host memory, staged one layer at a time (offload.py)
        state.offload = Stager(state, engine.adapter.device)
    if exact and engine.config.offloads_snapshots():  # recurrent snapshots but the latest in host memory
        for layer in state.layers:
            if isinstance(layer, RecurrentState):
                layer.host = True
    keep_graph_bytes = keep_graph_bytes if exact else 0
    if keep_graph_bytes > 0:
        state.enable_grad_buffers()  # the kept graphs add into these sinks in the walk
    if shard is not None and engine.divides_capture(ids.shape[0], keep_graph_bytes):
        # each prompt token computed on one rank, layer by layer (`parallel.divided.py`)
        divided_capture(engine.adapter, ids, state, shard, chunk_size=engine.config.chunk_size, exact=exact,
                        block_size=engine.config.attention_block_size)
    else:
        if exact and keep_attention_outputs:  # the walk's attention backward reads them (`state/kept_outputs.py`)
            state.outputs = KeptOutputs()
        capture_chunks(engine, ids, 0, [state], engine.config.chunk_size, "capture", keep_graph_bytes)
    stamp_state(state, engine, prompt, exact, prompt_inputs)
    return state


def rank_shard(engine) -> Shard | None:
    """This rank's deal of the prompt positions under context parallelism (None without)."""
    if engine.cp is None:
        return None
    block = engine.config.shard_block_size or engine.config.attention_block_size
    return Shard(rank=engine.cp.rank, world=engine.cp.world, block=block, cp=engine.cp)


def every_rank_owns_a_block(engine, positions: int) -> bool:
    """Whether `positions` prompt tokens deal at least one block to every rank (what a
    divided capture or walk needs; a shorter prompt runs replicated)."""
    return positions > (engine.cp.world - 1) * rank_shard(engine).block


def divides_walk(engine, state: PromptState) -> bool:
    """Whether exact mode's reverse walk over `state` runs divided (see `Engine.divides_walk`)."""
    if engine.cp is None or not (engine.config.divide_walk and engine.adapter.divides_walk):
        return False
    if state.offload is not None or state.kept:
        return False
    sharded = engine.adapter.sharded_modules()
    if sharded and fsdp_sum_factor(sharded, engine.cp) is None:
        return False
    return every_rank_owns_a_block(engine, state.length)


def divides_capture(engine, positions: int, keep_graph_bytes: int = 0) -> bool:
    """Whether a capture of `positions` tokens runs divided (see `Engine.divides_capture`)."""
    if engine.cp is None or not (engine.config.divide_capture and engine.adapter.divides_capture):
        return False
    return keep_graph_bytes == 0 and every_rank_owns_a_block(engine, positions)
