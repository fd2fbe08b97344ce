"""Warnings that are not the user's to act on, kept off the screen.

Each is filtered by its message (a `warnings.filterwarnings` `message=` regex, or a
`logging.Filter` on the one logger that prints it), never by category or module, so any
other warning of the same kind still shows. `install()` is idempotent; the CLI calls it
(`longstraw demo / train / grpo`), and so do `longstraw.integrations.trl` at import (a TRL
script builds its `GRPOConfig` after that import) and the trainer at construction.

What each is, and why the user cannot act on it:

* transformers 5's "`gradient_checkpointing` is deprecated ... Use `activation_checkpointing`"
  (FutureWarning, `TrainingArguments.__post_init__`): TRL's `GRPOConfig` sets the old name
  itself (its default is True), and LongStrawGRPOTrainer turns it off anyway.
* "`is_gradient_checkpointing` is deprecated ..." (FutureWarning, once per step): TRL's
  `unwrap_model_for_generation` reads the old property name.
* "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to
  save in a single process" (UserWarning, at each checkpoint save): the trainer's
  checkpoints go through torch.distributed.checkpoint in one process too, on purpose.
* transformers' "The tokenizer has new PAD/BOS/EOS tokens that differ from the model
  config ..." (`transformers.trainer_utils` logger, at trainer construction): the Trainer
  aligns the model's config to the tokenizer and says so; the tokenizer is the one given,
  and the alignment is what is wanted.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["install", "WARNINGS", "LOGGED"]

WARNINGS = (
    (FutureWarning, r"`gradient_checkpointing` is deprecated and will be removed in v6"),
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated and will be removed in v6"),
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to save "
                  r"in a single process"),
)
"""(category, message regex) of each `warnings` warning filtered (see the module doc)."""

LOGGED = (("transformers.trainer_utils", "The tokenizer has new PAD/BOS/EOS tokens that differ from the model config"),)
"""(logger, message start) of each log record dropped (see the module doc)."""


class _DropMessage(logging.Filter):
    """Drops the records whose message starts with `start`; every other record passes."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def install() -> None:
    """Filter `WARNINGS` and `LOGGED` (again: a filter already there is not added twice).
    Inserted first, so it holds even inside a `warnings.catch_warnings()` that shows all."""
    for category, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, start in LOGGED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))
