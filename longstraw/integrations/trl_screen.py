"""What `LongStrawGRPOTrainer` says on the screen beyond TRL's own log lines.

* Steps that changed no weight: each optimizer step's groups are counted (`step`); when
  every group of most steps was skipped (equal rewards, so every advantage is 0; or every
  completion token masked; or a non-finite gradient), one `skips.NoUpdateWarning` says so
  with what to change in TRL's terms (`skips.TRL_ADVICE`). A run shorter than four steps
  is judged when it ends.
* The loss: TRL logs `loss` and `grad_norm` side by side; on-policy GRPO's loss is about 0
  (`num_iterations=1`: the importance ratio is 1 and each group's advantages sum to 0)
  while its gradient is not, so the first logged loss of about 0 gets one note saying so
  (`skips.loss_note`) through this module's logger.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from longstraw.skips import TRL_ADVICE, SkipWatch, loss_note, no_update_reason

__all__ = ["ScreenCallback", "LOSS_ABOUT_ZERO"]

logger = logging.getLogger("longstraw.integrations.trl")

LOSS_ABOUT_ZERO = 1e-4
"""|loss| at or below this, with a non-zero gradient norm, gets the note."""


class ScreenCallback(TrainerCallback):
    """The skip watch and the loss note of one trainer (rank 0 alone speaks)."""

    def __init__(self, speaks: bool = True):
        self.watch = SkipWatch("LongStrawGRPOTrainer", TRL_ADVICE)
        self.speaks, self.noted = speaks, False

    def step(self, window: dict) -> None:
        """One optimizer step's counts (the trainer's metrics window, summed over the
        data-parallel groups): groups, skipped_zero_advantage, skipped_no_loss_tokens,
        nonfinite_grad."""
        if not self.speaks or not window.get("groups"):
            return
        record = {key: window.get(key, 0.0) for key in ("nonfinite_grad", "skipped_zero_advantage",
                                                        "skipped_no_loss_tokens")}
        self.watch.step(no_update_reason(record, int(window["groups"])))

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.speaks and not self.noted and "loss" in logs and abs(logs["loss"]) <= LOSS_ABOUT_ZERO:
            norm = logs.get("grad_norm")
            if norm is None or norm > 0:
                self.noted = True
                logger.warning("LongStrawGRPOTrainer: %s", loss_note(logs["loss"], norm))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.speaks:
            self.watch.finish()
        return control
