"""The LongStraw engine: capture -> (score) -> replay, one branch at a time.

1. Capture runs prompt[:-1] in chunks of `chunk_size` under no_grad. The adapter
   keeps only the per-layer state later tokens need (K/V for attention layers).
2. Replay runs each branch `[prompt[-1]] + response[:-1]` at positions P-1 .. with
   autograd against the read-only state, computes that branch's share of the group
   loss, calls backward, and frees the graph before the next branch. Peak memory is
   parameters + grads + state + one branch's graph, independent of G.
3. Exact mode (`ExecConfig(mode="exact")`): replay also sums dLoss/dState over the
   branches into buffers the state owns. Then the capture chunks are walked in
   reverse: each is recomputed with autograd from the state of earlier chunks, and
   its accumulated state gradient is pushed through it. That adds its parameter
   gradients and the gradients of earlier chunks' state. The result is the
   full-sequence gradient at state-sized memory (see docs/exact.md).
4. `step` only accumulates `.grad`, exactly as `loss.backward()` would; the caller
   steps the optimizer.

The engine knows no architecture: everything model-specific is in `models/`.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from . import grpo as G
from .config import ExecConfig, GRPOConfig
from .errors import ConfigError, InvalidGroupError, PositionLimitError
from .group import BatchTotals, Group, StepResult, validate_group
from .logprobs import token_logprobs
from .models import adapter_for
from .state import PromptState


def _progress(iterable, *, enabled: bool, desc: str, total: int):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)


class Engine:
    """Runs GRPO updates for one long shared prompt at a time.

    Args:
        model: a stock Hugging Face `...ForCausalLM` of a supported family, or a
            PEFT-wrapped one, in any dtype, on any device.
        config: how to execute (`ExecConfig`); defaults to `ExecConfig()`.
    """

    def __init__(self, model: nn.Module, config: ExecConfig | None = None):
        config = ExecConfig() if config is None else config
        if not isinstance(config, ExecConfig):
            raise ConfigError(f"config must be a longstraw.ExecConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self.adapter = adapter_for(model)

    # ------------------------------------------------------------------------
    # validation: everything is checked before the first expensive step

    def _validate(self, group: Group, *, needs_ref: bool = False, needs_rewards: bool = True):
        rewards = validate_group(group, vocab_size=self.adapter.vocab_size, needs_ref=needs_ref,
                                 needs_rewards=needs_rewards)
        longest = max(int(r.numel()) for r in group.responses)
        limit = self.adapter.max_positions
        total = int(group.prompt.numel()) + longest
        if limit is not None and total > limit and not self.config.allow_position_overflow:
            raise PositionLimitError(
                f"prompt ({group.prompt.numel()}) + longest response ({longest}) = {total} tokens exceeds the "
                f"model's max_position_embeddings={limit}; shorten the input or pass "
                "ExecConfig(allow_position_overflow=True)"
            )
        self.adapter.check_runnable()
        return rewards

    @staticmethod
    def _check_totals(group: Group, totals: BatchTotals) -> None:
        if not isinstance(totals, BatchTotals):
            raise InvalidGroupError(f"totals must be a longstraw.BatchTotals, got {type(totals).__name__}")
        longest = max(int(r.numel()) for r in group.responses)
        if (totals.num_sequences < group.size or totals.num_tokens < group.response_tokens
                or totals.max_response_tokens < longest):
            raise InvalidGroupError(
                f"totals {totals} are smaller than this group alone (G={group.size}, "
                f"tokens={group.response_tokens}, longest={longest}); pass BatchTotals.of(all groups of the batch)"
            )

    # ------------------------------------------------------------------------
    # the phases

    def _chunk_starts(self, prompt: torch.Tensor) -> range:
        return range(0, prompt.shape[0] - 1, self.config.chunk_size)

    def capture(self, prompt: torch.Tensor, *, exact: bool = False) -> PromptState:
        """Run prompt[:-1] ([P-1] tokens) in chunks under no_grad; return its state.
        With `exact`, the state also gets zeroed gradient buffers for replay to fill."""
        ids = prompt[:-1].to(self.adapter.device)
        state = self.adapter.new_state(ids.shape[0], exact=exact)
        size, starts = self.config.chunk_size, self._chunk_starts(prompt)
        with torch.no_grad():
            for s in _progress(starts, enabled=self.config.progress, desc="capture", total=len(starts)):
                self.adapter.run(ids[s : s + size], s, state, phase="capture",
                                 block_size=self.config.attention_block_size)
        if exact:
            state.enable_grad_buffers()
        return state

    def reverse_walk(self, state: PromptState, prompt: torch.Tensor) -> None:
        """Exact mode: push the accumulated state gradients back through the prompt.

        Chunks are recomputed last to first, each with autograd from the state of
        earlier chunks. The chunk's own state tensors are seeded with their
        accumulated gradients (complete by now: later chunks and all branches are
        done); backward adds parameter gradients and the gradients of earlier
        chunks' state. One chunk's graph is alive at a time.
        """
        ids = prompt[:-1].to(self.adapter.device)
        size, starts = self.config.chunk_size, self._chunk_starts(prompt)
        for s in _progress(reversed(starts), enabled=self.config.progress, desc="reverse", total=len(starts)):
            state.seeds = []
            with torch.enable_grad():
                self.adapter.run(ids[s : s + size], s, state, phase="recompute",
                                 block_size=self.config.attention_block_size)
            seeds = [(t, g) for t, g in state.seeds if t.requires_grad]
            state.seeds = []
            if seeds:
                torch.autograd.backward([t for t, _ in seeds], [g for _, g in seeds])
            del seeds

    def branch_logprobs(self, state: PromptState, prompt: torch.Tensor, response: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [R] of one response, replayed against `state`.
        Builds a graph when grad is enabled; the state is only read."""
        device = self.adapter.device
        inputs = torch.cat([prompt[-1:], response[:-1]]).to(device)  # (R,)
        hidden = self.adapter.run(inputs, prompt.shape[0] - 1, state, phase="replay",
                                  block_size=self.config.attention_block_size)
        return token_logprobs(self.adapter.lm_head, hidden, response.to(device), temperature=temperature,
                              chunk_size=self.config.logits_chunk_size)

    # ------------------------------------------------------------------------
    # public API

    def score(self, group: Group, temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-token log-probs under the current model, no grad.

        Returns:
            list of G tensors [R_i] (detached, on the model's device).
        """
        GRPOConfig(temperature=temperature)  # validates the temperature
        self._validate(group, needs_rewards=False)
        state = self.capture(group.prompt)
        with torch.no_grad():
            return [self.branch_logprobs(state, group.prompt, r, temperature).detach() for r in group.responses]

    def step(self, group: Group, grpo: GRPOConfig | None = None, *, totals: BatchTotals | None = None) -> StepResult:
        """One GRPO group: accumulate this group's share of the loss gradient into `.grad`.

        Args:
            group: the prompt, its G responses and rewards.
            grpo: the objective; defaults to `GRPOConfig()`.
            totals: batch-wide divisors when a batch of several groups is stepped one
                group at a time; defaults to this group alone.

        Returns:
            StepResult with the loss (this group's share) and metrics.
        """
        grpo = GRPOConfig() if grpo is None else grpo
        if not isinstance(grpo, GRPOConfig):
            raise ConfigError(f"grpo must be a longstraw.GRPOConfig, got {type(grpo).__name__}")
        rewards = self._validate(group, needs_ref=grpo.beta > 0)
        totals = BatchTotals.of([group]) if totals is None else totals
        self._check_totals(group, totals)

        t0 = time.perf_counter()
        equal = bool(rewards.max() == rewards.min())
        adv = torch.zeros_like(rewards) if equal else G.advantages(rewards, grpo)
        metrics = {
            "prompt_tokens": float(group.prompt.numel()),
            "response_tokens": float(group.response_tokens),
            "num_branches": float(group.size),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if group.size > 1 else 0.0,
            "advantage_mean": float(adv.mean()),
            "advantage_std": float(adv.std()) if group.size > 1 else 0.0,
            "advantage_min": float(adv.min()),
            "advantage_max": float(adv.max()),
            "skipped_zero_advantage": 0.0,
        }
        if equal and grpo.beta == 0:
            # Zero advantage and no KL term: the loss and its gradient are exactly 0.
            metrics.update(skipped_zero_advantage=1.0, state_bytes=0.0, state_grad_bytes=0.0, time_capture_s=0.0,
                           time_replay_s=0.0, time_reverse_s=0.0, time_total_s=0.0)
            return StepResult(loss=0.0, metrics=metrics)

        exact = self.config.mode == "exact"
        state = self.capture(group.prompt, exact=exact)
        t1 = time.perf_counter()
        loss_total, n_tok, ratio_sum, clip_sum, kl_sum = 0.0, 0, 0.0, 0.0, 0.0
        branches = list(enumerate(group.responses))
        for i, response in _progress(branches, enabled=self.config.progress, desc="replay", total=len(branches)):
            logp = self.branch_logprobs(state, group.prompt, response, grpo.temperature)  # (R,)
            old = logp.detach() if group.old_logprobs is None else group.old_logprobs[i].to(logp)
            ref = group.ref_logprobs[i].to(logp) if grpo.beta > 0 else None
            per_tok, stats = G.per_token_loss(logp, old, float(adv[i]), grpo, ref)
            loss = per_tok.sum() * G.branch_weight(grpo, totals, response.numel())
            loss.backward()
            del logp, per_tok  # free this branch's graph before the next one
            loss_total += float(loss.detach())
            n_tok += response.numel()
            ratio_sum += float(stats["ratio"].sum())
            clip_sum += float(stats["clipped"].sum())
            kl_sum += float(stats["kl"].sum()) if "kl" in stats else 0.0
        t2 = time.perf_counter()
        if exact:
            self.reverse_walk(state, group.prompt)
        t3 = time.perf_counter()
        metrics.update(
            state_bytes=float(state.nbytes()),
            state_grad_bytes=float(state.grad_nbytes()),
            time_capture_s=t1 - t0,
            time_replay_s=t2 - t1,
            time_reverse_s=t3 - t2,
            time_total_s=t3 - t0,
            ratio_mean=ratio_sum / n_tok,
            clip_fraction=clip_sum / n_tok,
        )
        if grpo.beta > 0:
            metrics["kl_mean"] = kl_sum / n_tok
        return StepResult(loss=loss_total, metrics=metrics)
