"""The unit of work (`Group`), its result (`StepResult`), batch-wide divisors
(`BatchTotals`), and input validation.

A group is one shared prompt of P tokens and G sampled responses of R_i tokens.
Validation runs before any model work, so a bad group leaves `.grad` untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidGroupError


@dataclass(kw_only=True)
class Group:
    """One prompt and its G responses.

    Args:
        prompt: LongTensor [P], P >= 2.
        responses: list of G LongTensors [R_i], R_i >= 1.
        rewards: float tensor [G] (or anything `torch.as_tensor` takes).
        old_logprobs: optional list of G float tensors [R_i]: the sampling policy's
            per-token log-probs. None means on-policy (old = current, detached).
        ref_logprobs: optional list of G float tensors [R_i] of the reference
            policy; needed when `GRPOConfig.beta > 0`.
    """

    prompt: torch.Tensor
    responses: list
    rewards: torch.Tensor
    old_logprobs: list | None = None
    ref_logprobs: list | None = None

    @property
    def size(self) -> int:
        return len(self.responses)

    @property
    def response_tokens(self) -> int:
        return sum(int(r.numel()) for r in self.responses)


@dataclass(kw_only=True)
class BatchTotals:
    """Batch-wide divisors, for a batch of several groups stepped one at a time.

    Pass the same `BatchTotals` to every `Engine.step` of the batch; the summed
    `.grad` then equals the gradient of one loss over the whole batch.

    Args:
        num_sequences: responses in the whole batch (divisor of "grpo", "dr_grpo").
        num_tokens: response tokens in the whole batch (divisor of "dapo").
        max_response_tokens: longest response of the batch ("dr_grpo" when
            `GRPOConfig.max_completion_length` is None).
    """

    num_sequences: int
    num_tokens: int
    max_response_tokens: int

    @classmethod
    def of(cls, groups) -> "BatchTotals":
        """Totals over an iterable of `Group`s."""
        groups = list(groups)
        if not groups:
            raise InvalidGroupError("BatchTotals.of needs at least one group")
        return cls(
            num_sequences=sum(g.size for g in groups),
            num_tokens=sum(g.response_tokens for g in groups),
            max_response_tokens=max(int(r.numel()) for g in groups for r in g.responses),
        )

    def __post_init__(self):
        for name in ("num_sequences", "num_tokens", "max_response_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidGroupError(f"BatchTotals.{name} must be a positive int, got {value!r}")


@dataclass
class StepResult:
    """What `Engine.step` returns. `.grad` has been accumulated on the model."""

    loss: float
    """This group's share of the (batch) loss; their sum over a batch is the batch loss."""
    metrics: dict = field(default_factory=dict)
    """Floats: timings, state bytes, token counts, advantage and ratio statistics."""


# ----------------------------------------------------------------------------
# validation


def check_token_ids(name: str, ids, vocab_size: int, min_len: int) -> None:
    if not isinstance(ids, torch.Tensor):
        raise InvalidGroupError(f"{name} must be a torch.LongTensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise InvalidGroupError(f"{name} must hold integer token ids (int64), got dtype {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidGroupError(f"{name} must be 1-D [tokens], got shape {tuple(ids.shape)}")
    if ids.numel() < min_len:
        raise InvalidGroupError(f"{name} must have at least {min_len} token(s), got {ids.numel()}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise InvalidGroupError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def _check_logprobs(name: str, values, responses) -> None:
    if not isinstance(values, (list, tuple)) or len(values) != len(responses):
        raise InvalidGroupError(f"group.{name} must be a list of {len(responses)} tensors (one per response)")
    for i, (lp, r) in enumerate(zip(values, responses)):
        if not isinstance(lp, torch.Tensor) or lp.shape != r.shape:
            shape = tuple(lp.shape) if isinstance(lp, torch.Tensor) else type(lp).__name__
            raise InvalidGroupError(f"group.{name}[{i}] must be a tensor of shape {tuple(r.shape)}, got {shape}")
        if not lp.is_floating_point() or not torch.isfinite(lp).all():
            raise InvalidGroupError(f"group.{name}[{i}] must be finite floats")


def validate_group(group: Group, *, vocab_size: int, needs_ref: bool = False, needs_rewards: bool = True) -> torch.Tensor:
    """Check a group before any work; return its rewards as a float64 tensor [G].

    Raises:
        InvalidGroupError: with a message naming the bad field and value.
    """
    if not isinstance(group, Group):
        raise InvalidGroupError(f"expected a longstraw.Group, got {type(group).__name__}")
    check_token_ids("group.prompt", group.prompt, vocab_size, min_len=2)
    if not isinstance(group.responses, (list, tuple)) or len(group.responses) == 0:
        raise InvalidGroupError("group.responses must be a non-empty list of LongTensors (G >= 1)")
    for i, r in enumerate(group.responses):
        check_token_ids(f"group.responses[{i}]", r, vocab_size, min_len=1)
    rewards = None
    if needs_rewards:
        try:
            rewards = torch.as_tensor(group.rewards).detach().to("cpu", torch.float64)
        except Exception as exc:  # noqa: BLE001 - re-raised as our type
            raise InvalidGroupError(f"group.rewards must be a float tensor [G]: {exc}") from exc
        if rewards.dim() != 1 or rewards.numel() != group.size:
            raise InvalidGroupError(
                f"group.rewards must have shape [{group.size}] (one per response), got {tuple(rewards.shape)}"
            )
        if not torch.isfinite(rewards).all():
            raise InvalidGroupError(f"group.rewards must be finite, got {rewards.tolist()}")
    if group.old_logprobs is not None:
        _check_logprobs("old_logprobs", group.old_logprobs, group.responses)
    if needs_ref:
        if group.ref_logprobs is None:
            raise InvalidGroupError("GRPOConfig.beta > 0 needs group.ref_logprobs (reference per-token log-probs)")
        _check_logprobs("ref_logprobs", group.ref_logprobs, group.responses)
    return rewards
