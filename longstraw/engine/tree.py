"""Prefix trees: `step` and `score` over the trie of a group's responses (`trie.py`),
each shared segment computed once (`ExecConfig(share_response_prefixes=True)`).

A shared segment is a small prompt for its children. Depth first from the prompt:

1. Capture the segment's inputs in chunks under no_grad, on top of the stacked states
   [prompt, the segments above it], into the segment's own state (K/V rows, GDN
   snapshots at every chunk boundary and at the fork, MLA latent rows and indexer keys),
   allocated as a branch's earlier pieces are (`replay.replay_branch`): exact, with
   gradient buffers.
2. Its children run on top of [prompt, ..., this segment]; reading its rows adds their
   dLoss/dState into its buffers, summed over every descendant.
3. Walk the segment back (`walk.walk_back`), chunk by chunk last to first: each chunk is
   recomputed with autograd, its own state tensors are seeded with the accumulated
   gradient, and its own loss terms join the same backward. That pushes the gradient
   on into the segments above it (and into the prompt state in exact mode; detached
   mode's prompt state is only read).

A leaf (one response's own tail, or identical responses) is a branch: its earlier
pieces are captured, the last is not, exactly as `replay_branch` runs a flat branch.
So with nothing shared the tree runs the flat path's work, segment for branch.

A token of a shared segment belongs to every member. Its loss is the sum of the
members' own terms, each `grpo.branch_loss` with that member's advantage, weight
(`grpo.branch_weight`: its 1/L_i for "grpo", 1/num_tokens for "dapo", 1/(G*max_len)
for "dr_grpo"), old / ref log-probs and mask, all from the one log-prob tensor: the
flat loss, term for term. (With on-policy old log-probs the terms share the ratio, so
this is the log-prob times the summed advantage-weights, where no clip binds.)

Memory: the prompt state, the states (and state gradients) of the segments on the
current path, and one chunk's or piece's graph; it does not grow with the leaves.
"""

from __future__ import annotations

import torch

from longstraw.config import GRPOConfig
from longstraw.engine import grpo as G
from longstraw.engine.batched import batch_size, replay_together
from longstraw.engine.capture import capture_chunks
from longstraw.engine.clock import ProgressCounter
from longstraw.host import on_host
from longstraw.engine.replay import BranchStats
from longstraw.engine.trie import Segment, build_trie
from longstraw.group import BatchTotals, Group
from longstraw.phase import Phase
from longstraw.state.prompt import PromptState


def segment_inputs(prompt: torch.Tensor, response: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The inputs [seg.tokens] of `seg`: [prompt[-1]] + response[:-1] at seg's positions."""
    before = prompt[-1:] if seg.start == 0 else response[seg.start - 1: seg.start]
    return torch.cat([before, response[seg.start: seg.end - 1]])


def segment_size(engine, seg: Segment) -> int:
    """Tokens per piece of `seg`: a leaf's pieces are a branch's (`branch_chunk_size`,
    default one piece); a segment with children is chunked like the prompt
    (`chunk_size`, or `branch_chunk_size` if smaller), never one graph."""
    piece = engine.config.branch_chunk_size
    if not seg.children:
        return piece or seg.tokens
    return min(piece or engine.config.chunk_size, engine.config.chunk_size)


def replay_tree(engine, state: PromptState, group: Group, grpo: GRPOConfig, totals: BatchTotals,
                adv: torch.Tensor) -> BranchStats:
    """`replay.replay_group` over the trie of `group`: every branch's loss backpropagated,
    each shared segment forwarded once; returns the branches' statistics (equal to the
    flat path's). `stats.forwarded`, `stats.shared`: tokens run, shared segments."""
    root = build_trie(group.responses, group.loss_masks)
    stats = BranchStats()
    stats.forwarded, stats.shared = root.forwarded_tokens(), root.shared_segments()  # (flat: every token, 0)
    weights = [G.branch_weight(grpo, totals, group.loss_tokens_of(i)) for i in range(group.size)]
    with on_host():  # real advantages [G], also in a rehearsal
        adv = [float(a) for a in adv]
    longest = max(r.shape[0] for r in group.responses)
    shared = stats.shared > 0  # a real tree; a flat group's leaves batch as the flat path's branches
    device = engine.adapter.device
    batch = stats.batch = batch_size(engine, state, group.size, longest, group.prompt.shape[0], tree=shared)

    def loss_of(seg: Segment):
        """(inputs [n], start, piece_loss) of `seg`: its members' loss terms from one log-prob tensor."""
        lead = group.responses[seg.members[0]]
        inputs = segment_inputs(group.prompt, lead, seg).to(device)  # (n,)
        target = lead[seg.start: seg.end].to(device)  # (n,)

        def piece_loss(hidden, a, b):
            logp = engine.logprobs(hidden, target[a:b], grpo.temperature)  # (b - a,), once for every member
            span, total = slice(seg.start + a, seg.start + b), 0.0
            for i in seg.members:
                loss, tok_stats = G.branch_loss(logp, group, i, adv[i], weights[i], grpo, span=span)
                stats.add(loss, tok_stats)
                total = total + loss
            return total
        return inputs, group.prompt.shape[0] - 1 + seg.start, piece_loss

    def ends_here(seg: Segment) -> int:
        return sum(group.responses[i].shape[0] == seg.end for i in seg.members)  # responses ending at seg

    def visit_children(children: list[Segment], stack: list[PromptState]) -> None:
        """Visit each child; with `replay_batch` b > 1, the leaves of one piece b at a time (`batched.py`)."""
        leaves = []

        def flush():
            if len(leaves) == 1:
                visit(leaves[0], stack)
            elif leaves:
                runs = [loss_of(leaf) for leaf in leaves]
                replay_together(engine, stack, runs[0][1], [x for x, _, _ in runs], [f for _, _, f in runs])
                bar.advance(sum(ends_here(leaf) for leaf in leaves))
            leaves.clear()
        for child in children:
            if batch > 1 and not child.children and child.tokens <= segment_size(engine, child):
                leaves.append(child)
                if len(leaves) == batch:
                    flush()
            else:
                visit(child, stack)
        flush()

    def visit(seg: Segment, stack: list[PromptState]) -> None:
        if seg.tokens == 0:  # the empty root: the responses differ from their first token
            visit_children(seg.children, stack)
            return
        inputs, start, piece_loss = loss_of(seg)
        size = segment_size(engine, seg)
        held = seg.tokens if seg.children else (seg.tokens - 1) // size * size  # a leaf: all but its last piece
        own = engine.adapter.new_state(held, start=start, exact=True)
        capture_chunks(engine, inputs[:held], start, stack + [own], size, None)
        own.enable_grad_buffers()
        visit_children(seg.children, stack + [own])  # each adds its dLoss/dState into `own` (and above)
        engine.walk_back(inputs, start, stack + [own], size, piece_loss=piece_loss, desc=None,
                         recompute_layers=engine.recomputes_layers(min(size, seg.tokens), stack[0]))  # as a flat branch's pieces
        bar.advance(ends_here(seg))

    with ProgressCounter(enabled=engine.config.progress, desc="replay", total=group.size) as bar:  # per response
        visit(root, [state])
    return stats


def capture_piece(engine, ids: torch.Tensor, start: int, states: list[PromptState]) -> torch.Tensor:
    """Capture ids [T] at positions start.. into states[-1] (no_grad held by the
    caller) and return their hidden states [T, d]."""
    hidden = engine.adapter.run(ids, start, states, phase=Phase.CAPTURE,
                                block_size=engine.config.attention_block_size)
    states[-1].length += ids.shape[0]
    return hidden


@torch.no_grad()
def score_tree(engine, state: PromptState, group: Group, temperature: float = 1.0) -> list[torch.Tensor]:
    """`score` over the trie of `group`'s tokens (masks ignored): G tensors [R_i] of
    per-token log-probs, each shared segment run once (a segment with children is
    captured chunk by chunk into its own state; a leaf runs in one piece, as a flat
    branch does)."""
    root = build_trie(group.responses)
    device, block = engine.adapter.device, engine.config.attention_block_size
    pieces: list[list[torch.Tensor]] = [[] for _ in group.responses]

    def visit(seg: Segment, stack: list[PromptState]) -> None:
        own = None
        if seg.tokens:
            lead = group.responses[seg.members[0]]
            inputs = segment_inputs(group.prompt, lead, seg).to(device)  # (n,)
            start = group.prompt.shape[0] - 1 + seg.start
            if seg.children:
                own, size = engine.adapter.new_state(seg.tokens, start=start), segment_size(engine, seg)
                hidden = torch.cat([capture_piece(engine, inputs[a: a + size], start + a, stack + [own])
                                    for a in range(0, seg.tokens, size)])  # (n, d)
            else:
                hidden = engine.adapter.run(inputs, start, stack, phase=Phase.REPLAY, block_size=block)  # (n, d)
            logp = engine.logprobs(hidden, lead[seg.start: seg.end].to(device), temperature)  # (n,)
            for i in seg.members:
                pieces[i].append(logp)
        for child in seg.children:
            visit(child, stack if own is None else stack + [own])

    visit(root, [state])
    return [torch.cat(p) for p in pieces]
