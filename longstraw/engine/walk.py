"""Exact mode's reverse walk (and a branch's walk over its pieces): recompute chunks last
to first with autograd from the state capture kept, seed each chunk's state tensors
with their accumulated gradients, and backpropagate before the next chunk. One chunk's
graph is alive at a time."""

from __future__ import annotations

import torch

from longstraw.engine.clock import progress
from longstraw.parallel.divided import divided_chunks
from longstraw.parallel.fsdp import gathered_when_read
from longstraw.phase import Phase
from longstraw.state.offload import settle
from longstraw.state.prompt import PromptState, Shard


def walk_back(engine, ids: torch.Tensor, start: int, states: list[PromptState], size: int, *,
              piece_loss=None, desc: str | None = "reverse", shard: Shard | None = None,
              recompute_layers: bool = False) -> None:
    """Recompute the chunks of ids [T] (positions start..) last to first and
    backpropagate through each (see `Engine.walk_back`)."""
    n = ids.shape[0]
    if shard is None:
        chunks = [(a, min(n, a + size), None) for a in range(0, n, size)]
    else:
        assert start == 0 and len(states) == 1, "a divided walk runs over the prompt state"
        chunks = divided_chunks(n, size, shard, at_chunks=engine.adapter.restarts_at_chunks)
    sharded = engine.adapter.sharded_modules()
    for a, b, divided in progress(chunks[::-1], enabled=engine.config.progress and len(chunks) > 1, desc=desc,
                                  total=len(chunks)):
        hidden, kept = None, states[-1].kept.pop(start + a, None)
        if kept is None:  # recompute the chunk (divided: this rank's positions of it) with autograd
            states[-1].seeds = []
            tokens = ids[a:b] if divided is None else ids[divided.positions(ids.device)]
            with torch.enable_grad(), gathered_when_read(sharded):  # FSDP2: backward may enter a layer by its rows
                hidden = engine.adapter.run(tokens, start + a, states, phase=Phase.RECOMPUTE,
                                            block_size=engine.config.attention_block_size, divided=divided,
                                            recompute_layers=recompute_layers)
            kept, states[-1].seeds = states[-1].seeds, []
        roots = [(t, g.to(device=t.device, dtype=t.dtype)) for tensors, read in kept for t, g in zip(tensors, read())
                 if g is not None and t.requires_grad]
        if piece_loss is not None:
            with torch.enable_grad():
                loss = piece_loss(hidden, a, b)  # hidden [b - a, d]
            roots.append((loss, torch.ones_like(loss)))
        if roots:
            torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
            settle(states)  # offloaded states: the last layers' gradient sinks back to host
        if states[-1].outputs is not None:  # kept attention outputs: this chunk's are spent
            states[-1].outputs.drop(start + a)
        del roots, hidden, kept
