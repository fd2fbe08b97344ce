"""The GRPO objective, with TRL's meanings: advantages, the per-token clipped
surrogate with optional k3 KL, and the divisor that turns sums into the loss.

The engine backprops one branch at a time, so the group loss is written as a sum of
per-branch terms, each `sum_t loss_{i,t} * weight_i`:

    dapo     weight_i = 1 / num_tokens                    (all loss tokens of the batch)
    grpo     weight_i = 1 / (L_i * num_sequences)         (L_i: response i's loss tokens)
    dr_grpo  weight_i = 1 / (num_sequences * max_completion_length)

A token that `Group.loss_masks` marks False has no loss term (TRL's `tool_mask`):
the sum runs over loss tokens only, and L_i and num_tokens count only those (each
at least 1, TRL's `clamp(min=1)`). Without masks, L_i = R_i.

With the batch-wide divisors of `BatchTotals`, stepping groups one at a time sums to
the gradient of the single batch loss.
"""

from __future__ import annotations

import torch

from longstraw.config import GRPOConfig
from longstraw.group import BatchTotals, Group

REWARD_STD_EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)


def advantages(rewards: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Group-relative advantages. rewards [G] -> [G] (float64).

    "group": (r - mean) / (std_unbiased + 1e-4); "none": r - mean. With G = 1 the
    unbiased std is undefined; it is taken as 0 (the advantage is 0 anyway).
    """
    rewards = rewards.to(torch.float64)
    centered = rewards - rewards.mean()
    if cfg.scale_rewards == "none":
        return centered
    std = rewards.std(unbiased=True) if rewards.numel() > 1 else rewards.new_zeros(())
    return centered / (std + REWARD_STD_EPS)


def group_advantages(rewards: torch.Tensor, cfg: GRPOConfig) -> tuple[torch.Tensor, bool]:
    """(advantages [G] float64, skip): all-equal rewards give zero advantages, and with
    no KL term (beta 0) the loss and its gradient are then exactly 0: `skip`."""
    equal = bool(rewards.max() == rewards.min())
    adv = torch.zeros_like(rewards) if equal else advantages(rewards, cfg)
    return adv, equal and cfg.beta == 0


def step_advantages(group: Group, rewards: torch.Tensor | None, cfg: GRPOConfig) -> tuple[torch.Tensor, bool]:
    """(advantages [G] float64, skip) of a validated group: `group.advantages` as given
    when set (skip when all are 0 and beta is 0), else `group_advantages(rewards)`."""
    if group.advantages is None:
        return group_advantages(rewards, cfg)
    adv = torch.as_tensor(group.advantages).detach().to("cpu", torch.float64)
    return adv, bool((adv == 0).all()) and cfg.beta == 0


def branch_weight(cfg: GRPOConfig, totals: BatchTotals, loss_tokens: int) -> float:
    """The factor that turns branch i's token-sum into its share of the batch loss;
    `loss_tokens`: the branch's loss tokens (its length without masks)."""
    if cfg.loss_type == "dapo":
        return 1.0 / totals.num_tokens
    if cfg.loss_type == "grpo":
        return 1.0 / (max(1, loss_tokens) * totals.num_sequences)
    max_len = cfg.max_completion_length or totals.max_response_tokens
    return 1.0 / (totals.num_sequences * max_len)


def per_token_loss(logp, old_logp, advantage, cfg: GRPOConfig, ref_logp=None):
    """TRL's per-token GRPO loss for one branch.

    Args:
        logp: [R] current log-probs (with graph).
        old_logp: [R] sampling-policy log-probs (detached).
        advantage: scalar advantage of the branch.
        ref_logp: [R] reference log-probs, used when cfg.beta > 0.

    Returns:
        (loss [R], stats) where stats holds detached [R] tensors: ratio, clipped
        (bool: the clip was active), and kl when beta > 0.
    """
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    loss = -torch.minimum(ratio * advantage, clipped_ratio * advantage)
    stats = {"ratio": ratio.detach(), "clipped": (clipped_ratio * advantage < ratio * advantage).detach()}
    if cfg.beta > 0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        loss = loss + cfg.beta * kl
        stats["kl"] = kl.detach()
    return loss, stats


def branch_loss(logp: torch.Tensor, group: Group, i: int, advantage: float, weight: float, cfg: GRPOConfig,
                span: slice = slice(None)):
    """Branch i's share of the group loss over its response tokens `span`: the
    per-token loss summed, times `weight` (`branch_weight`). The one loss assembly of
    every caller (the engine's replay pieces, and any naive full-sequence baseline).

    Args:
        logp: [n] current log-probs of the tokens `span` of response i (with graph).
        group: its old log-probs (None: on-policy, old = logp detached) and reference
            log-probs (read when cfg.beta > 0) give the same tokens' old / ref values;
            its loss mask (if any) drops the masked tokens' terms (KL included).

    Returns:
        (loss: a 0-dim tensor with graph, stats: `per_token_loss`'s detached [n]
        tensors, plus "mask" (bool [n]) when the group has loss masks: the tokens the
        statistics count).
    """
    old = logp.detach() if group.old_logprobs is None else group.old_logprobs[i][span].to(logp)
    ref = group.ref_logprobs[i][span].to(logp) if cfg.beta > 0 else None
    per_tok, stats = per_token_loss(logp, old, advantage, cfg, ref)
    if group.loss_masks is not None:
        mask = group.loss_masks[i][span].to(logp.device)  # (n,) bool
        per_tok = torch.where(mask, per_tok, torch.zeros_like(per_tok))  # no term, no gradient
        stats["mask"] = mask
    return per_tok.sum() * weight, stats
