"""`LongStrawGRPOTrainer`'s screen (integrations/trl_screen.py): most steps without an
update warn once with what to change in TRL's terms; a loss of about 0 gets its note."""

import logging
import warnings

import pytest
import torch

import longstraw as ls
from longstraw import quiet
from longstraw.skips import NoUpdateWarning
from tests.reference import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer  # noqa: E402


def _trainer(tmp_path, reward):
    args = trl.GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=2, max_steps=3, save_strategy="steps", save_steps=3, logging_steps=1,
                          learning_rate=1e-2, use_cpu=True, bf16=False, report_to=[], seed=0)
    prompts = [" ".join(str(3 + (5 * k + j) % 90) for j in range(6)) for k in range(4)]
    return LongStrawGRPOTrainer(model=tiny_model("qwen3", dtype=torch.float32), reward_funcs=reward, args=args,
                                train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                                processing_class=token_id_tokenizer(97, eos_token_id=1),
                                longstraw_config=ls.ExecConfig(chunk_size=4))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class _SpreadOnce:
    """Rewards 0, 1 on the first step's group (an update: loss about 0, gradient not),
    then equal rewards (no update)."""

    __name__ = "spread_once"

    def __init__(self):
        self.calls = 0

    def __call__(self, completion_ids, **kwargs):
        self.calls += 1
        return [float(self.calls == 1 and k % 2) for k in range(len(completion_ids))]


def test_most_steps_without_an_update_warn_once_the_loss_gets_its_note_and_nothing_else_shows(tmp_path, caplog):
    """With every warning shown (as -W always), TRL's GRPOConfig, construction, three steps
    and a checkpoint save raise none but ours
    (quiet.py: transformers' gradient-checkpointing FutureWarnings, the PAD/BOS/EOS notice,
    torch.distributed's single-process save warning)."""
    notices = _Records()  # what transformers' trainer_utils logger lets through (its filters run first)
    logging.getLogger("transformers.trainer_utils").addHandler(notices)
    try:
        with caplog.at_level(logging.WARNING, logger="longstraw.integrations.trl"), \
                warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet.install()  # as a script sees it: longstraw.integrations.trl imported (installed) before GRPOConfig
            trainer = _trainer(tmp_path, _SpreadOnce())
            trainer.train()
    finally:
        logging.getLogger("transformers.trainer_utils").removeHandler(notices)
    assert [w.category for w in seen] == [NoUpdateWarning], [str(w.message) for w in seen]
    ours = list(seen)
    assert (tmp_path / "run" / "checkpoint-3").exists()
    assert not any("PAD/BOS/EOS" in m for m in notices.messages), notices.messages
    text = str(ours[0].message)
    assert text.startswith("LongStrawGRPOTrainer: 2 of 3 steps") and "num_generations" in text  # at the end
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["longstraw/skipped_zero_advantage"] for h in logs] == [0.0, 1.0, 1.0]
    notes = [r.getMessage() for r in caplog.records if "about 0 by construction" in r.getMessage()]
    assert len(notes) == 1 and "gradient norm" in notes[0]  # TRL logs grad_norm beside the loss
