"""The learning experiment's arms beyond `longstraw train`'s own (detached, exact):

    full  the naive baseline: one Hugging Face forward + backward per branch over
          prompt + response, with the same GRPO loss (`grpo.branch_loss`), so the same
          gradient as exact mode; it samples its rollouts like the other arms
          (engine.generate from the captured state, same per-step generator), so with
          one seed exact and full follow the same curve up to float rounding.

    tree  detached mode on TreeRL-style tree rollouts with fork-level advantages
          (`bench/learning/tree.py`)

and the experiment's second model preset, "hybrid" (Qwen3.6-shaped). `LearningConfig`
is `TrainConfig` with both; `run(cfg)` runs one arm through `longstraw.train.train`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from longstraw.config import GRPOConfig
from longstraw.engine import grpo as G
from longstraw.engine.logprobs import scaled_log_softmax
from longstraw.group import BatchTotals, Group
from bench.learning.tree import TREE_ROOTS, tree_rollouts
from longstraw.train import ARMS, MODEL_PRESETS, TrainConfig, train

# The dense preset's large RoPE base (see longstraw.train.MODEL_PRESETS): at long P the
# model fails by dilution, not by rotary angles it never saw.
ROPE_THETA = 1e9

PRESETS = {
    **MODEL_PRESETS,
    # Qwen3.6-shaped hybrid: 3 Gated DeltaNet layers : 1 gated full-attention layer.
    "hybrid": ("qwen3_5", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                               rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA,
                                                "partial_rotary_factor": 0.25})),
}


@dataclass(kw_only=True)
class LearningConfig(TrainConfig):
    """`TrainConfig` with the experiment's "full" and "tree" arms and "hybrid" preset."""

    arms: ClassVar[tuple] = ARMS + ("full", "tree")
    presets: ClassVar[dict] = PRESETS

    def __post_init__(self):
        super().__post_init__()
        if self.arm == "tree" and self.group_size % TREE_ROOTS:
            raise ValueError(f"the tree arm forks {TREE_ROOTS} root episodes equally: group_size must be a "
                             f"multiple of {TREE_ROOTS}, got {self.group_size}")


def full_sequence_logprobs(model, prompt: torch.Tensor, response: torch.Tensor, temperature: float = 1.0):
    """One HF forward over prompt + response: [R] log-probs of the response tokens."""
    ids = torch.cat([prompt, response])  # (P + R,)
    logits = model(ids[None], logits_to_keep=response.numel() + 1).logits[0, :-1]  # (R, V)
    return scaled_log_softmax(logits, temperature).gather(-1, response[:, None])[:, 0]


def full_sequence_step(model, group: Group, grpo: GRPOConfig, totals: BatchTotals | None = None) -> dict:
    """The naive update: one full-sequence forward + backward per branch, with the same
    GRPO loss as `Engine.step` (so the same gradient as exact mode). Accumulates .grad."""
    totals = BatchTotals.of([group]) if totals is None else totals
    rewards = torch.as_tensor(group.rewards, dtype=torch.float64)
    adv, skip = G.group_advantages(rewards, grpo)
    if skip:
        return {"loss": 0.0, "skipped_zero_advantage": 1.0, "clip_fraction": 0.0}
    total, clipped, tokens = 0.0, 0.0, 0
    for i, response in enumerate(group.responses):
        logp = full_sequence_logprobs(model, group.prompt, response, grpo.temperature)  # (R_i,)
        weight = G.branch_weight(grpo, totals, response.numel())
        loss, stats = G.branch_loss(logp, group, i, float(adv[i]), weight, grpo)
        loss.backward()
        total += float(loss.detach())
        clipped += float(stats["clipped"].sum())
        tokens += response.numel()
    return {"loss": total, "skipped_zero_advantage": 0.0, "clip_fraction": clipped / tokens}


def full_update(run, group: Group, state, grpo: GRPOConfig, totals: BatchTotals) -> dict:
    """`train`'s update for the full arm (the rollout's prompt state is not used)."""
    return full_sequence_step(run.model, group, grpo, totals)


def run(cfg: TrainConfig) -> dict:
    """One arm's training run (`longstraw.train.train`; the full arm with its own update, the tree arm
    with its own rollouts)."""
    return train(cfg, update=full_update if cfg.arm == "full" else None,
                 rollouts=tree_rollouts if cfg.arm == "tree" else None)
