"""Replay: each branch `[prompt[-1]] + response[:-1]` ([R] tokens at positions P-1..)
runs with autograd against the read-only prompt state, its share of the group loss
(`grpo.branch_loss`) is backpropagated, and its graph is freed before the next branch;
and the no-grad scoring of one branch. Running per-token statistics stay on the device
until the step reads them once (`BranchStats`)."""

from __future__ import annotations

import torch

from longstraw.config import GRPOConfig
from longstraw.engine import grpo as G
from longstraw.engine.batched import batch_size, replay_together
from longstraw.engine.capture import capture_chunks
from longstraw.engine.clock import progress
from longstraw.host import on_host, to_host
from longstraw.group import BatchTotals, Group
from longstraw.phase import Phase
from longstraw.state.prompt import PromptState


class BranchStats:
    """Running sums of the per-token statistics over all branches and pieces, kept as
    device tensors (no host sync per piece); read once at the end."""

    def __init__(self):
        self.loss, self.tokens, self.ratio, self.clipped, self.kl = 0.0, 0, 0.0, 0.0, 0.0
        self.forwarded, self.shared = 0, 0  # response tokens run through the model; shared segments (`tree.py`)
        self.batch = 1  # branches replayed as one batch (`batched.batch_size`)

    def add(self, loss: torch.Tensor, tok_stats: dict) -> None:
        """Add one piece: its loss and `grpo.branch_loss`'s stats (only the tokens its
        "mask", if any, keeps are counted)."""
        keep = tok_stats.get("mask")

        def total(name):
            values = tok_stats[name].detach()
            return (values if keep is None else torch.where(keep, values, torch.zeros_like(values))).sum()

        self.loss = self.loss + loss.detach()
        self.tokens = self.tokens + (tok_stats["ratio"].numel() if keep is None else keep.sum())
        self.ratio = self.ratio + total("ratio")
        self.clipped = self.clipped + total("clipped")
        self.kl = self.kl + (total("kl") if "kl" in tok_stats else 0.0)

    def summary(self, with_kl: bool) -> dict:
        """The statistics as floats: one host sync (`host.to_host`) for all of them."""
        parts = [self.tokens, self.ratio, self.clipped, self.kl]
        held = [p.detach().double().reshape(()) for p in parts if isinstance(p, torch.Tensor)]
        values = iter(to_host(torch.stack(held), list) if held else [])
        n, ratio, clipped, kl = (next(values) if isinstance(p, torch.Tensor) else p for p in parts)
        tokens = max(1, int(n))  # a group with masks may count none (all its stats are then 0)
        out = {"ratio_mean": float(ratio) / tokens, "clip_fraction": float(clipped) / tokens}
        if with_kl:
            out["kl_mean"] = float(kl) / tokens
        return out


def replay_branch(engine, state: PromptState, prompt: torch.Tensor, response: torch.Tensor, piece_loss) -> None:
    """Backpropagate one branch's loss against the read-only prompt state (see
    `Engine.replay_branch`)."""
    inputs = torch.cat([prompt[-1:], response[:-1]]).to(engine.adapter.device)  # (R,)
    start, size = prompt.shape[0] - 1, engine.config.branch_chunk_size or inputs.shape[0]
    held = (inputs.shape[0] - 1) // size * size  # tokens of every piece but the last
    branch = engine.adapter.new_state(held, start=start, exact=True)
    capture_chunks(engine, inputs[:held], start, [state, branch], size, None)  # no bar inside replay's
    branch.enable_grad_buffers()
    engine.walk_back(inputs, start, [state, branch], size, piece_loss=piece_loss, desc=None,
                     recompute_layers=engine.recomputes_layers(min(size, inputs.shape[0]), state))


def branch_logprobs(engine, state: PromptState, prompt: torch.Tensor, response: torch.Tensor,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs [R] of one response against `state`, in one piece."""
    device = engine.adapter.device
    inputs = torch.cat([prompt[-1:], response[:-1]]).to(device)  # (R,)
    hidden = engine.adapter.run(inputs, prompt.shape[0] - 1, [state], phase=Phase.REPLAY,
                                block_size=engine.config.attention_block_size)  # (R, d)
    return engine.logprobs(hidden, response.to(device), temperature)


def replay_group(engine, state: PromptState, group: Group, grpo: GRPOConfig, totals: BatchTotals,
                 adv: torch.Tensor) -> BranchStats:
    """Replay every branch of `group` (advantages adv [G]) against `state`, one at a
    time (or, with `replay_batch` b > 1, those of one piece b at a time: `batched.py`),
    accumulating `.grad`; returns the branches' statistics."""
    stats = BranchStats()
    stats.forwarded = group.response_tokens
    with on_host():  # real advantages [G], also in a rehearsal
        adv = [float(a) for a in adv]
    longest = max(r.shape[0] for r in group.responses)
    batch = stats.batch = batch_size(engine, state, len(group.responses), longest, group.prompt.shape[0])
    pending = []  # one-piece branches waiting: (inputs, piece_loss)
    device, start = engine.adapter.device, group.prompt.shape[0] - 1

    def flush():
        if len(pending) == 1:
            engine.replay_branch(state, group.prompt, *pending[0][2:])
        elif pending:
            replay_together(engine, [state], start, [x for x, *_ in pending], [f for _, f, *_ in pending])
        pending.clear()

    branches = list(enumerate(group.responses))
    for i, response in progress(branches, enabled=engine.config.progress, desc="replay", total=len(branches)):
        weight = G.branch_weight(grpo, totals, group.loss_tokens_of(i))
        target = response.to(device)  # (R_i,)

        def piece_loss(hidden, a, b, i=i, weight=weight, target=target):
            logp = engine.logprobs(hidden, target[a:b], grpo.temperature)  # (b - a,)
            loss, tok_stats = G.branch_loss(logp, group, i, adv[i], weight, grpo, span=slice(a, b))
            stats.add(loss, tok_stats)
            return loss

        if batch > 1 and response.shape[0] <= (engine.config.branch_chunk_size or response.shape[0]):
            inputs = torch.cat([group.prompt[-1:], response[:-1]]).to(device)  # (R_i,)
            pending.append((inputs, piece_loss, response, piece_loss))
            if len(pending) == batch:
                flush()
        else:
            engine.replay_branch(state, group.prompt, response, piece_loss)
    flush()
    return stats
