"""The GRPO objective, with TRL's meanings: advantages, the per-token clipped
surrogate with optional k3 KL, and the divisor that turns sums into the loss.

The engine backprops one branch at a time, so the group loss is written as a sum of
per-branch terms, each `sum_t loss_{i,t} * weight_i`:

    dapo     weight_i = 1 / num_tokens                    (all response tokens of the batch)
    grpo     weight_i = 1 / (R_i * num_sequences)
    dr_grpo  weight_i = 1 / (num_sequences * max_completion_length)

With the batch-wide divisors of `BatchTotals`, stepping groups one at a time sums to
the gradient of the single batch loss.
"""

from __future__ import annotations

import torch

from longstraw.config import GRPOConfig
from longstraw.group import BatchTotals

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


def branch_weight(cfg: GRPOConfig, totals: BatchTotals, response_len: int) -> float:
    """The factor that turns branch i's token-sum into its share of the batch loss."""
    if cfg.loss_type == "dapo":
        return 1.0 / totals.num_tokens
    if cfg.loss_type == "grpo":
        return 1.0 / (response_len * totals.num_sequences)
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
