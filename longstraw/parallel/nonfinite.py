"""Non-finite steps skipped on every rank, agreed with one all-reduce.

A NaN or inf in any rank's gradient (its own shard under FSDP2, its replica otherwise)
must skip the optimizer step on *every* rank: a rank that stepped while another skipped
would leave the replicas apart for good. `NonFiniteGuard.agree` folds the local verdict
into a single-element float64 flag and all-reduces it with MAX over the group (the
default group unless given): one collective per step, 8 bytes. A skipped step zeroes the
gradients, counts itself (`skipped_nonfinite_steps`, and the current run of them), and
`max_in_row` skipped steps in a row raise `NonFiniteError`: the weights are the last good
ones, the checkpoint on disk too.

`inject(step)` is the test hook: LONGSTRAW_FAULT="nan@R:S" makes rank R's gradients NaN
at step S (0-based), so a test sees every rank skip what one rank broke.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from longstraw.errors import NonFiniteError
from longstraw.parallel.launch import faults

DEFAULT_MAX_NONFINITE_STEPS = 3
"""Skipped non-finite steps in a row before `NonFiniteError` (every entry point's default)."""


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's shard (FSDP2)


def local_nonfinite(params) -> bool:
    """True when any gradient of `params` held by this rank has a NaN or inf."""
    bad = [(~torch.isfinite(_local(p.grad))).any() for p in params if p.grad is not None]
    return bool(torch.stack(bad).any()) if bad else False


def all_finite(params=None, *, local: bool | None = None, group=None, device=None) -> bool:
    """True when every rank's gradients are finite: this rank's verdict (`local`: "is
    non-finite", or computed from `params`) as a one-element float64 flag all-reduced with
    MAX over `group` (the default group; nothing to agree on outside torch.distributed).
    One collective, 8 bytes."""
    bad = local_nonfinite(params) if local is None else bool(local)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        flag = torch.tensor([float(bad)], dtype=torch.float64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        bad = bool(flag.item() > 0)
    return not bad


@dataclass(kw_only=True, slots=True)
class NonFiniteGuard:
    """The counters of skipped steps; `agree` then `record` once per optimizer step."""

    max_in_row: int = DEFAULT_MAX_NONFINITE_STEPS
    """Skipped steps in a row that raise `NonFiniteError` (>= 1)."""
    in_row: int = 0
    """Skipped steps since the last good one."""
    total: int = 0
    """Skipped steps of the run (the `skipped_nonfinite_steps` metric)."""

    def __post_init__(self):
        if self.max_in_row < 1:
            raise ValueError(f"max_in_row (max_nonfinite_steps) must be >= 1, got {self.max_in_row}")

    def agree(self, params=None, *, local: bool | None = None, group=None, device=None) -> bool:
        """`all_finite` (one all-reduce over `group`, the default group)."""
        return all_finite(params, local=local, group=group, device=device)

    def skip_if_nonfinite(self, params, step: int, *, rank: int = 0, group=None, device=None) -> bool:
        """The whole guard for loops whose optimizer step is taken by someone else (HF's
        Trainer): the test hook, the agreement, and on a non-finite step every `.grad`
        set to None (torch optimizers leave a parameter without a gradient untouched:
        weights and moments stay), counted; NonFiniteError at `max_in_row`. Returns
        whether the step was skipped."""
        params = list(params)
        inject(params, step, rank)
        finite = self.agree(params, group=group, device=device)
        if not finite:
            for p in params:
                p.grad = None
        self.record(finite, step)
        return not finite

    def record(self, finite: bool, step: int, what: str = "gradient") -> None:
        """Count this step; raise NonFiniteError at `max_in_row` skipped steps in a row."""
        if finite:
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        if self.in_row >= self.max_in_row:
            raise NonFiniteError(
                f"the {what} was not finite on some rank for {self.in_row} steps in a row (steps "
                f"{step + 2 - self.in_row}..{step + 1}); each update was skipped on every rank, so the weights and the "
                "last checkpoint are the last good ones. Lower the learning rate, check the rewards and the dtype, "
                f"or raise max_nonfinite_steps (now {self.max_in_row})")

    def state(self) -> dict:
        """The counters, for a checkpoint (`load_state` restores them)."""
        return {"in_row": self.in_row, "total": self.total}

    def load_state(self, state: dict) -> None:
        self.in_row, self.total = int(state.get("in_row", 0)), int(state.get("total", 0))


# ----------------------------------------------------------------------------
# the test hook


def inject(params, step: int, rank: int) -> None:
    """LONGSTRAW_FAULT="nan@R:S": at step S rank R's gradients become NaN (test hook; a
    parameter without a gradient, e.g. a step whose groups all had zero advantage, gets a
    NaN one)."""
    if (rank, step) in faults("nan"):
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    p.grad = torch.full_like(p, float("nan"))
                else:
                    _local(p.grad).fill_(float("nan"))


__all__ = ["DEFAULT_MAX_NONFINITE_STEPS", "NonFiniteGuard", "all_finite", "inject", "local_nonfinite"]
