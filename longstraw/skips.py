"""Steps that changed no weight, said on the screen.

A GRPO step updates nothing when every group of it is skipped: all responses of a group
got the same reward (every advantage is 0), every response token is masked (no loss
term), or the gradient was not finite (the optimizer step is skipped). One such step is
normal; a run where most steps skip looks like a run that trains while it does not. So:

    watch = SkipWatch("longstraw train", advice=TRAIN_ADVICE, total=cfg.steps)
    for step in ...:
        watch.step(no_update_reason(record, groups), reward_mean=record["reward_mean"])
    watch.finish()

warns once (`NoUpdateWarning`, a UserWarning) as soon as more than half of at least
`min(4, total)` steps skipped, with the reason and what to change in the caller's terms
(flags for the CLI, `GRPOConfig` fields for the TRL trainer). `finish()` warns a shorter
run that never reached the count.

`LOSS_NOTE` is the one line that explains an on-policy loss of about 0 beside the
gradient norm (the demo's table, the TRL trainer's first log).
"""

from __future__ import annotations

import warnings
from collections import Counter

__all__ = ["NoUpdateWarning", "SkipWatch", "no_update_reason", "loss_note", "TRAIN_ADVICE", "TRL_ADVICE",
           "DEMO_ADVICE"]


class NoUpdateWarning(UserWarning):
    """Most steps of a run changed no weight (`SkipWatch`)."""


KINDS = ("equal rewards", "no loss tokens", "non-finite gradient")
"""The reasons a step changes no weight, as they appear inside `no_update_reason`'s text."""

WHY = {"equal rewards": "every response of a group got the same reward, so every advantage is 0",
       "no loss tokens": "every response token is masked, so there is no loss term",
       "non-finite gradient": "the gradient norm was NaN/inf, so the optimizer step was skipped"}

TRAIN_ADVICE = {
    "equal rewards": "if every reward was 0 the policy never succeeds at this --prompt-tokens: more --warm-steps "
                     "or a shorter --prompt-tokens; if every reward was 1 it always does: fewer --warm-steps or a "
                     "longer --prompt-tokens; a larger --group-size or --temperature spreads the rewards",
    "no loss tokens": "the task's loss masks hide every sampled token: check the task (--task)",
    "non-finite gradient": "lower --lr or --grad-clip, or use --dtype float64",
}
"""What to change, in `longstraw train`'s flags."""

TRL_ADVICE = {
    "equal rewards": "a reward function that gives partial credit, more GRPOConfig(num_generations=...), a higher "
                     "temperature, or prompts the model solves sometimes but not always (a longer warm start, "
                     "an easier task)",
    "no loss tokens": "every completion token is a tool result (tool_mask 0): check the tools' output",
    "non-finite gradient": "a lower learning_rate or max_grad_norm, or a float32/float64 model",
}
"""What to change, in TRL's `GRPOConfig` and data terms."""

DEMO_ADVICE = {
    "equal rewards": "another --seed, a larger --group or a longer --response-tokens",
    "no loss tokens": "a longer --response-tokens",
    "non-finite gradient": "--dtype float64",
}
"""What to change, in `longstraw demo`'s flags."""


def no_update_reason(record: dict, groups: int) -> str | None:
    """Why a step's record changed no weight, in the words the progress bar and the log show
    ("no update (equal rewards)", ...), or None when the step updated. `groups`: groups per step.
    `record` holds nonfinite_grad, skipped_zero_advantage and skipped_no_loss_tokens (counts)."""
    if record["nonfinite_grad"]:
        return "no update (non-finite gradient, skipped)"
    equal, masked = record["skipped_zero_advantage"], record["skipped_no_loss_tokens"]
    if equal + masked < groups:
        return None  # at least one group had a gradient
    if masked == 0:
        return "no update (equal rewards)" if groups == 1 else f"no update (equal rewards in all {groups} groups)"
    if equal == 0:
        return "no update (no loss tokens: every response token masked)"
    return "no update (equal rewards or no loss tokens in every group)"


def loss_note(loss: float, grad_norm: float | None) -> str:
    """The loss line's explanation: on-policy GRPO's loss is about 0 while its gradient is
    not (`grad_norm` None: not measured)."""
    norm = "" if grad_norm is None else f" with gradient norm {grad_norm:.4g}"
    return (f"loss {loss:.6f}{norm}: on-policy GRPO's loss is about 0 by construction (each group's advantages "
            "sum to 0 and the importance ratio is 1); its gradient is what trains, so follow the reward and the "
            "gradient norm, not the loss")


class SkipWatch:
    """Counts a run's steps that changed no weight; warns once when most did.

    Args:
        who: what the warning names ("longstraw train", "LongStrawGRPOTrainer").
        advice: kind (one of `KINDS`) -> what to change, in the caller's terms.
        total: the run's steps, if known: a run shorter than `after` is judged at its end.
        after: the fewest steps seen before the share is judged (default 4).
        share: warn when more than this share of the steps seen skipped (default 0.5).
    """

    def __init__(self, who: str, advice: dict, *, total: int | None = None, after: int = 4, share: float = 0.5):
        self.who, self.advice, self.share = who, advice, share
        self.after = after if total is None else max(1, min(after, total))
        self.steps = self.skipped = 0
        self.kinds: Counter = Counter()
        self.rewards: list = []
        self.warned = False

    def step(self, reason: str | None, reward_mean: float | None = None) -> None:
        """One step: `reason` is `no_update_reason`'s text (None: it updated)."""
        self.steps += 1
        if reason is not None:
            self.skipped += 1
            kind = next((k for k in KINDS if k in reason), "equal rewards")
            self.kinds[kind] += 1
            if kind == "equal rewards" and reward_mean is not None:
                self.rewards.append(float(reward_mean))
        if self.steps >= self.after:
            self._judge()

    def finish(self) -> None:
        """At the end of the run: judge a run shorter than `after` steps too."""
        if self.steps:
            self._judge()

    def message(self) -> str:
        """The warning's text: how many steps skipped, why, and what to change."""
        parts = []
        for kind, n in self.kinds.most_common():
            seen = ""
            if kind == "equal rewards" and self.rewards:
                lo, hi = min(self.rewards), max(self.rewards)
                seen = f"; their reward mean was {lo:.2f}" + (f" to {hi:.2f}" if hi > lo else "")
            parts.append(f"{n} for {kind} ({WHY[kind]}{seen}). To change: {self.advice[kind]}")
        return (f"{self.who}: {self.skipped} of {self.steps} steps so far changed no weight: " + "; ".join(parts))

    def _judge(self) -> None:
        if not self.warned and self.skipped > self.share * self.steps:
            self.warned = True
            # no source line on the screen (the call site is a library loop, not the user's code):
            # `longstraw:0: NoUpdateWarning: <who>: ...`
            warnings.warn_explicit(self.message(), NoUpdateWarning, filename="longstraw", lineno=0,
                                   module="longstraw.skips")
