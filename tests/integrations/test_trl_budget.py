"""`LongStrawGRPOTrainer(longstraw_memory_budget=...)` (`integrations/trl_budget.py`): the
engine runs `ls.fit_config`'s choice for the trainer's step (G = num_generations, R =
max_completion_length, P = longstraw_prompt_tokens), with `longstraw_config`'s own fields
pinned and a generation batch's other held states counted; nothing fitting raises
`DoesNotFitError` at construction; a prompt longer than the P fitted is refused before
its capture."""

import pytest
import torch

import longstraw as ls
from longstraw.tiny import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer  # noqa: E402

VOCAB, EOS, MiB = 97, 1, 2**20
# tiny qwen3 at P = 8,192, G = 4, R = 4 (detached), the fits measured from the planner:
# 60 MiB fits with chunk 2,048 for one state and with chunk 512 when a second prompt's
# state is held; 40 MiB fits one state only (chunk 512); 20 MiB fits nothing.
P = 8192


def _prompts(n, length=9):
    g = torch.Generator().manual_seed(0)
    return [" ".join(str(int(t)) for t in torch.randint(2, VOCAB, (length,), generator=g)) for _ in range(n)]


def _reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]


def _trainer(tmp_path, budget, config=None, keep_states=True, prompt_tokens=P, **overrides):
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_generations=4, max_completion_length=4, max_steps=1, save_strategy="no", learning_rate=1e-2,
                use_cpu=True, bf16=False, report_to=[], seed=0, logging_steps=1)
    return LongStrawGRPOTrainer(model=tiny_model("qwen3", dtype=torch.float32), reward_funcs=_reward,
                                args=trl.GRPOConfig(**{**args, **overrides}),
                                train_dataset=datasets.Dataset.from_dict({"prompt": _prompts(4)}),
                                processing_class=token_id_tokenizer(VOCAB, eos_token_id=EOS),
                                longstraw_config=config, longstraw_keep_states=keep_states,
                                longstraw_memory_budget=budget, longstraw_prompt_tokens=prompt_tokens)


def _fit(model, budget, held_states, **fixed):
    return ls.fit_config(model, memory_budget=budget, prompt_tokens=P, group=4, response_tokens=4,
                         held_states=held_states, generate=True, **fixed)


def test_the_budget_picks_the_engine_config_counting_held_states(tmp_path):
    held = _trainer(tmp_path, "60MiB")  # 8 rows per generation batch: 2 prompts, both states kept
    model = held.longstraw_engine.model
    assert held.longstraw_engine.config == _fit(model, 60 * MiB, 1) and held.longstraw_engine.config.chunk_size == 512
    dropped = _trainer(tmp_path, "60MiB", keep_states=False)  # one state at a time
    assert dropped.longstraw_engine.config == _fit(model, 60 * MiB, 0)
    assert dropped.longstraw_engine.config.chunk_size == 2048
    pinned = _trainer(tmp_path, "1GiB", config=ls.ExecConfig(chunk_size=1024, mode="exact"), keep_states=False)
    assert pinned.longstraw_engine.config.chunk_size == 1024 and pinned.longstraw_engine.config.mode == "exact"
    with pytest.raises(ls.DoesNotFitError, match="other prompt state"):
        _trainer(tmp_path, "40MiB")  # fits one state, not two


def test_nothing_fits_raises_at_construction(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(LongStrawGRPOTrainer, "_rollouts", lambda *a, **k: calls.append(1))
    with pytest.raises(ls.DoesNotFitError, match=r"longstraw_memory_budget='20MiB'.*binding term") as err:
        _trainer(tmp_path, "20MiB", keep_states=False)
    assert "longstraw_prompt_tokens" in str(err.value) and calls == []
    with pytest.raises(ls.ConfigError, match="longstraw_prompt_tokens must be"):
        _trainer(tmp_path, "1GiB", prompt_tokens=0)
    default = _trainer(tmp_path, "1GiB", prompt_tokens=None)  # the longest prompt the model can take
    assert default.longstraw_prompt_tokens == default.longstraw_engine.model.config.max_position_embeddings - 4


def test_a_fitted_trainer_trains_and_refuses_a_longer_prompt(tmp_path):
    trainer = _trainer(tmp_path, "1GiB", prompt_tokens=16)
    trainer.train()
    assert [h for h in trainer.state.log_history if "loss" in h][0]["longstraw/captures"] >= 1
    short = _trainer(tmp_path, "1GiB", prompt_tokens=8)  # the prompts have 9 tokens
    with pytest.raises(ls.ConfigError, match="prompt of 9 tokens is longer than the 8"):
        short.train()


def test_a_prompt_with_images_under_a_text_fitted_budget_warns():
    """The trainer fits its budget before it sees the dataset: a prompt that brings images
    warns that the tower's activations are not in it; text prompts, or no budget, do not."""
    import warnings

    from longstraw.integrations.trl_budget import UnfittedImagesWarning, warn_unfitted_images

    images = {"pixel_values": torch.zeros(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.warns(UnfittedImagesWarning, match="fitted for text prompts"):
        warn_unfitted_images(images, "1GiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unfitted_images(images, None)
        warn_unfitted_images({}, "1GiB")
        warn_unfitted_images(None, "1GiB")
