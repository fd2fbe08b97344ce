"""Batched replay (`ExecConfig.replay_batch`): b branches that each run in one piece go
through the model as one batch against the same stacked states, instead of one at a time.

Each branch j has inputs [n_j] at positions start.. (a flat branch: [prompt[-1]] +
response[:-1] from P - 1; a tree's leaf: its segment's inputs) and its own loss. The
batch is [b, n] with n the longest; a shorter branch is padded at its end with its own
last input, which its earlier positions never see (every mixer is causal) and whose
outputs no loss reads. One run with autograd (phase REPLAY: the states are only read,
their gradient buffers filled by backward), the b losses summed, one backward: the
state's gradient is the sum over the batch, as b separate backwards would make it. Every
mixer reads the shared prompt state without copying it per branch: attention folds the
batch into the query rows of the prefix (`ops/rows.py`), a GDN layer expands its snapshot
over the batch (`models/gated_deltanet._gdn_batch`), an MLA layer runs each branch's
attention in turn (`models/mla_batch.each_branch`); norms, projections and MLPs see b*n rows.

Its naive twin is `replay_batch=1` (`replay.replay_branch`, `tree.replay_tree` one leaf at
a time): tests/engine/test_batched_replay.py checks float64 gradients equal to 1e-12.
"""

from __future__ import annotations

import torch

from longstraw.defaults import replay_batch_for
from longstraw.parallel.fsdp import gathered_when_read
from longstraw.phase import Phase
from longstraw.state.offload import settle
from longstraw.state.prompt import PromptState


def batch_size(engine, state: PromptState, group: int, tokens: int, prompt_tokens: int, tree: bool = False) -> int:
    """The most branches replayed as one batch against `state` (of a `prompt_tokens` prompt),
    of a group of `group` branches whose longest has `tokens` tokens: `replay_batch` (at
    most `group`); None: `defaults.replay_batch_for`, which batches one-piece branches of
    a flat group, where the family takes a batch and there is no context parallelism, as
    far as their tokens fit in exact mode's walk chunk (when the walk keeps its whole
    graph): a graph the step holds anyway. A tree's leaves, and detached mode: 1. Always 1
    for a prompt with images (their rows are looked up by sequence index, one sequence)."""
    if state.inputs is not None:
        return 1
    setting, c = engine.config.replay_batch, engine.config
    one_piece = tokens <= (c.branch_chunk_size or tokens)
    batches = setting is None and not tree and one_piece and engine.adapter.batches_replay and engine.cp is None
    positions = prompt_tokens - 1
    free = min(c.chunk_size, positions) if batches and c.mode == "exact" and positions > 0 \
        and not engine.walk_recomputes_layers(positions, state) else 0
    return replay_batch_for(setting, group=group, batches=batches, response_tokens=tokens, free_tokens=free)


def padded(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The branches' inputs [n_j] as one batch [b, n] (n the longest), each padded at its
    end with its own last input."""
    longest = max(x.shape[0] for x in inputs)
    return torch.stack([torch.cat([x, x[-1:].expand(longest - x.shape[0])]) for x in inputs])


def replay_together(engine, stack: list[PromptState], start: int, inputs: list[torch.Tensor], losses) -> None:
    """Backpropagate b branches' losses in one batch against `stack` (see the module
    docstring). inputs: b LongTensors [n_j] on the model's device, at positions start..;
    losses[j](hidden [n_j, d], 0, n_j) -> branch j's loss (a 0-dim tensor with graph)."""
    ids = padded(inputs)  # (b, n)
    recompute = engine.recomputes_layers(ids.numel(), stack[0])  # the batch's graph, as one piece of b*n tokens
    with torch.enable_grad(), gathered_when_read(engine.adapter.sharded_modules()):
        hidden = engine.adapter.run(ids, start, stack, phase=Phase.REPLAY,
                                    block_size=engine.config.attention_block_size,
                                    recompute_layers=recompute)  # (b, n, d)
        loss = sum(f(hidden[j, :x.shape[0]], 0, x.shape[0]) for j, (x, f) in enumerate(zip(inputs, losses)))
    torch.autograd.backward([loss], [torch.ones_like(loss)])
    settle(stack)  # offloaded states: the last layers' gradient sinks back to host
