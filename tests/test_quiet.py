"""`quiet.install()`: each warning that is not the user's to act on is dropped by its
message; another warning of the same category (or logger) still shows."""

import logging
import warnings

from longstraw import quiet


def test_each_known_warning_is_dropped_by_message_and_others_still_show(caplog):
    messages = ["`gradient_checkpointing` is deprecated and will be removed in v6. Use `activation_checkpointing` "
                "instead.", "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use "
                "`is_activation_checkpointing` instead.", "torch.distributed is disabled, unavailable or "
                "uninitialized, assuming the intent is to save in a single process."]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # as -W always: everything shows ...
        quiet.install()  # ... but these
        quiet.install()  # idempotent
        for (category, _), text in zip(quiet.WARNINGS, messages, strict=True):
            warnings.warn(text, category)
        warnings.warn("`foo` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("something else in torch.distributed", UserWarning)
    assert [str(w.message) for w in seen] == ["`foo` is deprecated and will be removed in v6.",
                                              "something else in torch.distributed"]
    logger = logging.getLogger("transformers.trainer_utils")
    with caplog.at_level(logging.WARNING):
        logger.warning("The tokenizer has new PAD/BOS/EOS tokens that differ from the model config and generation "
                       "config. Updated tokens: {'eos_token_id': 1}.")
        logger.warning("another notice")
    assert [r.getMessage() for r in caplog.records] == ["another notice"]
    assert sum(type(f).__name__ == "_DropMessage" for f in logger.filters) == 1
