"""The unit of work (`Group`), its result (`StepResult`), batch-wide divisors
(`BatchTotals`), and input validation.

A group is one shared prompt of P tokens and G sampled responses of R_i tokens.
Validation runs before any model work, so a bad group leaves `.grad` untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidGroupError
from .host import on_host


@dataclass(kw_only=True)
class Group:
    """One prompt and its G responses.

    Args:
        prompt: LongTensor [P], P >= 2.
        responses: list of G LongTensors [R_i], R_i >= 1.
        rewards: float tensor [G] (or anything `torch.as_tensor` takes). May be None
            when `advantages` is given (then it only feeds the reward metrics).
        old_logprobs: optional list of G float tensors [R_i]: the sampling policy's
            per-token log-probs. None means on-policy (old = current, detached).
        ref_logprobs: optional list of G float tensors [R_i] of the reference
            policy; needed when `GRPOConfig.beta > 0`.
        loss_masks: optional list of G bool tensors [R_i] (TRL's `tool_mask`). A False
            token (a tool's or environment's output) stays in the sequence, and later
            tokens attend to it, but it has no loss term (nor KL term) and is counted in
            no normaliser. None: every token is a loss token. A response whose mask is
            all False contributes nothing (it still counts as a sequence, as in TRL).
        advantages: optional float tensor [G], used as given instead of the advantages
            computed from `rewards`.
        prompt_inputs: optional dict of the prompt's non-text inputs, named as Hugging
            Face's processor names them: `pixel_values` [patches, C * t * p * p],
            `image_grid_thw` [images, 3] and `mm_token_type_ids` [P] (or [1, P]); images in
            the prompt only (responses are text). Checked against the model before any
            work (`models/vision.py`); None: a text prompt.
    """

    prompt: torch.Tensor
    responses: list
    rewards: torch.Tensor | None = None
    old_logprobs: list | None = None
    ref_logprobs: list | None = None
    loss_masks: list | None = None
    advantages: torch.Tensor | None = None
    prompt_inputs: dict | None = None

    @property
    def size(self) -> int:
        return len(self.responses)

    @property
    def response_tokens(self) -> int:
        """Every response token, masked ones included (the sequences' lengths)."""
        return sum(int(r.numel()) for r in self.responses)

    def loss_tokens_of(self, i: int) -> int:
        """Response i's loss tokens: those its loss mask keeps (all R_i without masks)."""
        if self.loss_masks is None:
            return int(self.responses[i].numel())
        with on_host():  # real masks, also in a rehearsal (`longstraw/host.py`)
            return int(self.loss_masks[i].sum())

    @property
    def loss_tokens(self) -> int:
        """Loss tokens of the whole group (every response token without masks)."""
        return sum(self.loss_tokens_of(i) for i in range(self.size))


@dataclass(kw_only=True)
class BatchTotals:
    """Batch-wide divisors, for a batch of several groups stepped one at a time.

    Pass the same `BatchTotals` to every `Engine.step` of the batch; the summed
    `.grad` then equals the gradient of one loss over the whole batch.

    Args:
        num_sequences: responses in the whole batch (divisor of "grpo", "dr_grpo").
        num_tokens: loss tokens in the whole batch (divisor of "dapo"): response
            tokens that `Group.loss_masks` keep.
        max_response_tokens: longest response of the batch ("dr_grpo" when
            `GRPOConfig.max_completion_length` is None). Its whole length, masked tokens
            included: it stands in for TRL's `max_completion_length`, which bounds the
            whole completion (tool tokens too) and does not change with the mask.
    """

    num_sequences: int
    num_tokens: int
    max_response_tokens: int

    @classmethod
    def of(cls, groups) -> "BatchTotals":
        """Totals over an iterable of `Group`s. `num_tokens` counts loss tokens only, at
        least 1 (TRL's `clamp(min=1)`: a batch without loss tokens has loss 0)."""
        groups = list(groups)
        if not groups:
            raise InvalidGroupError("BatchTotals.of needs at least one group")
        for g in groups:
            check_loss_masks(g)
        return cls(
            num_sequences=sum(g.size for g in groups),
            num_tokens=max(1, sum(g.loss_tokens for g in groups)),
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


def check_loss_masks(group: Group) -> None:
    """Refuse loss masks that are not G bool tensors shaped like their responses."""
    masks = group.loss_masks
    if masks is None:
        return
    if not isinstance(masks, (list, tuple)) or len(masks) != group.size:
        got = f"{len(masks)} masks" if isinstance(masks, (list, tuple)) else type(masks).__name__
        raise InvalidGroupError(f"group.loss_masks must be a list of {group.size} bool tensors (one per response), "
                                f"got {got}")
    for i, (m, r) in enumerate(zip(masks, group.responses)):
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            kind = f"dtype {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise InvalidGroupError(f"group.loss_masks[{i}] must be a bool tensor (True = loss token), got {kind}; "
                                    "convert a 0/1 mask with mask.bool()")
        if not isinstance(r, torch.Tensor) or m.shape != r.shape:
            want = tuple(r.shape) if isinstance(r, torch.Tensor) else "its response's"
            raise InvalidGroupError(f"group.loss_masks[{i}] has shape {tuple(m.shape)} but group.responses[{i}] has "
                                    f"shape {want}: one mask entry per response token")


def _as_float64(name: str, values, size: int) -> torch.Tensor:
    """values -> a finite float64 CPU tensor [size], or an InvalidGroupError."""
    try:
        out = torch.as_tensor(values).detach()
    except Exception as exc:  # noqa: BLE001 - re-raised as our type
        raise InvalidGroupError(f"{name} must be a float tensor [G]: {exc}") from exc
    if out.dim() != 1 or out.numel() != size:
        raise InvalidGroupError(f"{name} must have shape [{size}] (one per response), got {tuple(out.shape)}")
    return out.to("cpu", torch.float64)


def validate_group(group: Group, *, vocab_size: int, needs_ref: bool = False, needs_rewards: bool = True) -> torch.Tensor:
    """Check a group before any work; return its rewards as a float64 tensor [G] (None
    when not `needs_rewards`, or when only `advantages` are given). `needs_rewards`: the
    group is to be stepped, so it needs rewards or advantages (and checks both if given).

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
    check_loss_masks(group)
    rewards = None
    if needs_rewards and group.advantages is not None:
        adv = group.advantages
        if not (isinstance(adv, torch.Tensor) and adv.is_floating_point()):
            kind = f"dtype {adv.dtype}" if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise InvalidGroupError(f"group.advantages must be a float tensor [G], got {kind}")
        if not torch.isfinite(_as_float64("group.advantages", adv, group.size)).all():
            raise InvalidGroupError(f"group.advantages must be finite, got {adv.tolist()}")
    if needs_rewards and (group.rewards is not None or group.advantages is None):
        if group.rewards is None:
            raise InvalidGroupError("group.rewards is None: pass rewards [G], or advantages [G] to use as given")
        rewards = _as_float64("group.rewards", group.rewards, group.size)
        if not torch.isfinite(rewards).all():
            raise InvalidGroupError(f"group.rewards must be finite, got {rewards.tolist()}")
    if group.old_logprobs is not None:
        _check_logprobs("old_logprobs", group.old_logprobs, group.responses)
    if needs_ref:
        if group.ref_logprobs is None:
            raise InvalidGroupError("GRPOConfig.beta > 0 needs group.ref_logprobs (reference per-token log-probs)")
        _check_logprobs("ref_logprobs", group.ref_logprobs, group.responses)
    return rewards
