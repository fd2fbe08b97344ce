"""Everything the engine checks before the first expensive step: the group, the model's
position limit, the model's state, a reused prompt state and batch totals; and, under
context parallelism, the agreement of every rank on the verdict (all raise together).

The functions take the `Engine` whose model and config they check; `Engine` exposes
them as methods (`check_positions`, `check_runnable`, `agree_across_ranks`)."""

from __future__ import annotations

import torch

from longstraw.engine.inputs import check_inputs
from longstraw.engine.rollout import check_state
from longstraw.errors import ConfigError, InvalidGroupError, LongStrawError, PositionLimitError
from longstraw.group import BatchTotals, Group, validate_group
from longstraw.parallel.context import check_same_group


def sequence_length(group: Group) -> int:
    """P + the longest response: the length of HF's one-pass forward over the group."""
    return int(group.prompt.numel()) + max(int(r.numel()) for r in group.responses)


def fingerprint(group: Group | None, rewards) -> torch.Tensor:
    """A fixed-length float64 summary [10] of a group, to check that every rank got the
    same one (zeros for a group that failed validation): prompt, responses, rewards,
    loss masks (where they fall) and advantages."""
    if group is None:
        return torch.zeros(10, dtype=torch.float64)
    lengths = torch.tensor([float(r.numel()) for r in group.responses], dtype=torch.float64)
    sums = torch.tensor([float(r.double().sum()) for r in group.responses], dtype=torch.float64)
    weights = torch.arange(1, group.size + 1, dtype=torch.float64)  # order matters
    r = torch.zeros(group.size, dtype=torch.float64) if rewards is None else rewards.double().cpu()
    masks = -1.0 if group.loss_masks is None else sum(  # each kept token by its place
        float((torch.nonzero(m.cpu())[:, 0].double() + 1).sum()) * (i + 1) for i, m in enumerate(group.loss_masks))
    adv = -1.0 if group.advantages is None else float((group.advantages.detach().cpu().double() * weights).sum())
    return torch.tensor([float(group.prompt.numel()), float(group.prompt.double().sum()), float(group.size),
                         float((lengths * weights).sum()), float((sums * weights).sum()), float(r.sum()),
                         float((r * weights).sum()), float(rewards is not None), masks, adv], dtype=torch.float64)


def check_positions(engine, prompt_tokens: int, new_tokens: int, what: str) -> int:
    """Refuse prompt + `new_tokens` beyond the model's max_position_embeddings (unless
    `allow_position_overflow`); return the total."""
    limit, total = engine.adapter.max_positions, prompt_tokens + new_tokens
    if limit is not None and total > limit and not engine.config.allow_position_overflow:
        raise PositionLimitError(
            f"prompt ({prompt_tokens}) + {what} ({new_tokens}) = {total} tokens exceeds the model's "
            f"max_position_embeddings={limit}; shorten the input or pass ExecConfig(allow_position_overflow=True)"
        )
    return total


def check_runnable(engine) -> None:
    """Refuse model states and contexts we cannot run exactly (before any work)."""
    engine.adapter.check_runnable()
    if torch.is_autocast_enabled(engine.adapter.device.type):
        raise ConfigError(
            "torch.autocast is active: LongStraw's custom autograd kernels recompute in backward and would not "
            "see the same autocast state; load the model in bf16 instead (model.to(torch.bfloat16)): attention "
            "statistics, log-probs and the loss are computed in fp32 regardless"
        )


def agree_across_ranks(engine, local, fingerprint_of):
    """Run `local()` (it raises a LongStrawError on bad input) and return its result.
    Under context parallelism, one all-gather then tells every rank whether any rank
    failed or holds a different `fingerprint_of(result, failed)` (a fixed-length float64
    tensor), and all raise together: no rank waits out a timeout for a peer that
    raised. The failing rank raises its own error."""
    result, problem = None, None
    try:
        result = local()
    except LongStrawError as exc:
        if engine.cp is None:
            raise
        problem = exc
    if engine.cp is not None:
        try:
            check_same_group(fingerprint_of(result, problem is not None), engine.cp,
                             problem=f"{type(problem).__name__}: {problem}" if problem else "")
        except InvalidGroupError:
            if problem is not None:
                raise problem from None  # this rank's own error, after telling the others
            raise
    return result


def check_totals(group: Group, totals: BatchTotals) -> None:
    """Refuse batch totals smaller than this group alone."""
    if not isinstance(totals, BatchTotals):
        raise InvalidGroupError(f"totals must be a longstraw.BatchTotals, got {type(totals).__name__}")
    longest = max(int(r.numel()) for r in group.responses)
    if (totals.num_sequences < group.size or totals.num_tokens < group.loss_tokens
            or totals.max_response_tokens < longest):
        raise InvalidGroupError(
            f"totals {totals} are smaller than this group alone (G={group.size}, "
            f"loss tokens={group.loss_tokens}, longest={longest}); pass BatchTotals.of(all groups of the batch)"
        )


def validate_local(engine, group: Group, *, needs_ref: bool, needs_rewards: bool, totals, state):
    """This rank's checks of a group (and of a reused `state`). Returns the rewards."""
    rewards = validate_group(group, vocab_size=engine.adapter.vocab_size, needs_ref=needs_ref,
                             needs_rewards=needs_rewards)
    longest = max(int(r.numel()) for r in group.responses)
    total = engine.check_positions(int(group.prompt.numel()), longest, "longest response")
    engine.check_runnable()
    check_inputs(engine, group.prompt, group.prompt_inputs, group.responses)  # images: prompt only
    if engine.cp is not None:
        engine.adapter.check_context_parallel(total)
    if totals is not None:
        check_totals(group, totals)
    if state is not None:
        check_state(state, engine, group.prompt, total=total, inputs=group.prompt_inputs)
    return rewards


def validate(engine, group: Group, *, needs_ref: bool = False, needs_rewards: bool = True, totals=None,
             state=None):
    """Validate locally (and a reused `state`); under context parallelism every rank
    then learns whether any rank failed or was given a different group, and all raise
    together (`agree_across_ranks`). Returns the rewards."""
    return engine.agree_across_ranks(
        lambda: validate_local(engine, group, needs_ref=needs_ref, needs_rewards=needs_rewards, totals=totals,
                               state=state),
        lambda rewards, failed: fingerprint(None if failed else group, rewards))
