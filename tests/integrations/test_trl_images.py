"""Images through `LongStrawGRPOTrainer` (`integrations/trl_images.py`): TRL's image
datasets and a processor as `processing_class`.

The equivalence: the tiny VLM (float64), the offline processor, a dataset of two
screenshots per prompt; the trainer's first optimizer step (loss and every gradient, the
vision tower's included) equals `ls.Engine.step` on a copy of the model, fed prompt inputs
built here with the processor from the same messages, the trainer's sampled responses
and TRL's advantages. The tower runs once per image at the one capture per prompt.
"""

from __future__ import annotations

import copy

import pytest
import torch

import longstraw as ls
from longstraw.errors import ConfigError
from longstraw.integrations.trl_images import group_prompt_inputs
from longstraw.tiny import tiny_vlm
from longstraw.tiny_vision import screenshots, tiny_vlm_processor
from tests.reference import assert_grads_close, assert_loss_close

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from longstraw.integrations.trl import LongStrawGRPOTrainer  # noqa: E402
from trl.data_utils import prepare_multimodal_messages  # noqa: E402

EXACT = ls.ExecConfig(mode="exact", chunk_size=7)
PROMPTS = [[{"role": "user", "content": "12 7 3"}], [{"role": "user", "content": "5 9"}]]


def _images():
    shots = screenshots(4, height=64, width=96, seed=3)
    return [[shots[0], shots[1].resize((64, 32))], [shots[2].resize((32, 64)), shots[3]]]  # two grids each


def _reward(completion_ids, **kwargs):
    return [float(sum((k + 1) * t for k, t in enumerate(c)) % 11) for c in completion_ids]


class _Grads(trl.trainer.grpo_trainer.TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def image_dataset():
    """TRL's layout: conversational prompts and an `images` column (two screenshots each)."""
    return datasets.Dataset.from_dict({"prompt": PROMPTS, "images": _images()})


def _trainer(model, tmp_path, grads, **overrides):
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_generations=4, max_completion_length=3, max_steps=1, optim="sgd", learning_rate=1.0,
                lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, use_cpu=True, bf16=False,
                report_to=[], save_strategy="no", logging_steps=1, seed=0, disable_dropout=True)
    return LongStrawGRPOTrainer(model=model, reward_funcs=_reward, args=trl.GRPOConfig(**{**args, **overrides}),
                                train_dataset=image_dataset(), processing_class=tiny_vlm_processor(), callbacks=[grads],
                                longstraw_config=EXACT)


def _record(trainer):
    """The groups the trainer steps, and the tower's calls (with grad or not)."""
    engine, steps, tower = trainer.longstraw_engine, [], []
    real_step, real_features = engine.step, engine.model.model.get_image_features

    def step(group, grpo=None, **kwargs):
        steps.append((group, kwargs["totals"]))
        return real_step(group, grpo, **kwargs)

    def features(*a, **k):
        tower.append(torch.is_grad_enabled())
        return real_features(*a, **k)

    engine.step, engine.model.model.get_image_features = step, features
    return steps, tower


def _processor_inputs(prompt, images):
    """(prompt [P], prompt_inputs) from the processor, as a user would build them."""
    messages = prepare_multimodal_messages(copy.deepcopy(prompt), images=images)
    out = tiny_vlm_processor().apply_chat_template([messages], tokenize=True, add_generation_prompt=True,
                                                   return_dict=True, return_tensors="pt")
    return out["input_ids"][0], {k: out[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}


SMALL = dict(text=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       layer_types=["linear_attention", "full_attention"], num_key_value_heads=1, head_dim=8,
                       linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                     partial_rotary_factor=1.0, mrope_section=[2, 1, 1])),
             depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32)
"""`tiny_vlm` narrowed for the default suite (every M-RoPE axis rotates: sections [2, 1, 1])."""


@pytest.mark.parametrize("size", ["small", pytest.param("tiny", marks=pytest.mark.slow)])  # tiny: 84 s of CPU
def test_first_step_with_two_images_per_prompt_equals_engine_step(tmp_path, size):
    model = tiny_vlm(dtype=torch.float64, **(SMALL if size == "small" else {}))
    reference = copy.deepcopy(model)
    grads = _Grads()
    trainer = _trainer(model, tmp_path, grads)
    steps, tower = _record(trainer)
    trainer.train()

    assert len(steps) == 2 and tower.count(False) == 4  # one capture per prompt, the tower once per image
    engine = ls.Engine(reference, EXACT)
    groups = []
    for (group, _), prompt, images in zip(steps, PROMPTS, _images()):
        ids, inputs = _processor_inputs(prompt, images)
        assert torch.equal(group.prompt, ids)
        assert all(torch.equal(group.prompt_inputs[k], inputs[k].reshape(group.prompt_inputs[k].shape)) for k in inputs)
        groups.append(ls.Group(prompt=ids, responses=group.responses, rewards=group.rewards, prompt_inputs=inputs))
    totals = ls.BatchTotals.of(groups)
    loss = sum(engine.step(g, trainer.longstraw_grpo, totals=totals).loss for g in groups)
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}

    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert_loss_close(logged[0], loss, 1e-9)
    (got,) = grads.steps
    assert set(got) == set(want)
    tower_grads = [n for n in want if ".visual." in n]
    assert tower_grads and all(want[n].abs().sum() > 0 for n in tower_grads)  # exact mode trains the tower
    assert_grads_close(got, want, 1e-9)


def test_group_prompt_inputs_cuts_each_groups_images_out_of_the_batch():
    """TRL's batched fields (numpy pixels, per-row token-type lists, as the processor
    returns them untensored) -> each group's first row's images."""
    import numpy as np

    grid = np.array([[1, 2, 2], [1, 2, 4]] * 2 + [[1, 4, 2]] * 2)  # images of rows 0-1 (2 each) and 4-5 (1 each)
    pixels = np.arange(int(grid.prod(-1).sum()) * 3, dtype=np.float32).reshape(-1, 3)
    rows = [[0, 1], [0, 1], [5, 0, 0], [5, 0, 0], [7, 1, 1, 1], [7, 1, 1, 1]]  # groups of G = 2
    images = [["a", "b"], ["a", "b"], None, None, ["c"], ["c"]]
    types = [[0, 1], [0, 1], [0, 0, 0], [0, 0, 0], [0, 1, 1, 1], [0, 1, 1, 1]]
    got = group_prompt_inputs(rows, images, dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types), 2)
    assert got[1] is None
    assert got[0]["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    assert torch.equal(got[0]["pixel_values"], torch.from_numpy(pixels[:12]))
    assert got[2]["image_grid_thw"].tolist() == [[1, 4, 2]]
    assert torch.equal(got[2]["pixel_values"], torch.from_numpy(pixels[24:32]))
    assert got[2]["mm_token_type_ids"].tolist() == [0, 1, 1, 1]
    with pytest.raises(ConfigError, match="pixel_values_videos"):
        group_prompt_inputs(rows, images, dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=types,
                                               pixel_values_videos=pixels), 2)


# ----------------------------------------------------------------------------
# with TRL's tools


TOOL_TEMPLATE = (
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}"
    "{%- if p['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif p['type'] == 'text' -%}{{ ' ' + p['text'] + ' ' }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '<user> ' }}{{ text(m['content']) }}{{ ' <eos> ' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<a> ' }}{%- if m['content'] -%}{{ text(m['content']) + ' ' }}{%- endif -%}"
    "{%- for c in (m['tool_calls'] if m['tool_calls'] is defined and m['tool_calls'] else []) -%}"
    "{{ '<tool_call> ' + (c['function'] | tojson(separators=(',', ':'))) + ' </tool_call> ' }}{%- endfor -%}"
    "{{ '<eos> ' }}"
    "{%- elif m['role'] == 'tool' -%}{{ '<tool> ' }}{{ text(m['content']) }}{{ ' </tool> ' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<a>' }}{%- endif -%}"
)
"""`integrations.chat.CHAT_TEMPLATE` with content lists (TRL's VLM messages) and images."""


def _tool_processor():
    """The tiny VLM's offline processor over `tool_chat_tokenizer`'s words (ids < 4090) and
    Qwen's vision tokens at 4090-4093, with `TOOL_TEMPLATE`."""
    from longstraw.integrations.chat import tool_chat_tokenizer
    from longstraw.tiny_vision import TinyVLMProcessor

    tokenizer = tool_chat_tokenizer(4090)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                                "<|vision_end|>"]})
    tokenizer.chat_template = TOOL_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == 4090
    return TinyVLMProcessor(image_processor=tiny_vlm_processor().image_processor, tokenizer=tokenizer,
                            chat_template=TOOL_TEMPLATE)


@pytest.mark.slow
def test_tools_with_images_first_step_equals_engine_step(tmp_path):
    """TRL's tool loop over prompts with two screenshots each (scripted completions with 0, 1
    or 2 `lookup` calls, as tests/integrations/test_trl_tools.py): every continuation is
    served from the prompt's one capture with its images; the first step (tool results
    masked) equals `ls.Engine.step` on the processor's inputs."""
    from tests.integrations.test_trl_tools import _patch_longstraw, lookup

    model = tiny_vlm(dtype=torch.float64, **SMALL)
    reference = copy.deepcopy(model)
    grads, processor = _Grads(), _tool_processor()
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_generations=4, max_completion_length=24, max_tool_calling_iterations=2, max_steps=1,
                optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1, seed=0,
                disable_dropout=True, loss_type="grpo")
    trainer = LongStrawGRPOTrainer(model=model, reward_funcs=_reward, args=trl.GRPOConfig(**args),
                                   train_dataset=image_dataset(), processing_class=processor, tools=[lookup],
                                   callbacks=[grads], longstraw_config=EXACT)
    seen = _patch_longstraw(trainer)
    steps, tower = _record(trainer)
    trainer.train()

    assert len(seen["captures"]) == 2 and tower.count(False) == 4  # one capture per prompt, no second tower pass
    assert any(n > 0 for n, _ in seen["generates"])  # continuations after tool results, from the held states
    engine, groups = ls.Engine(reference, EXACT), []
    for (group, _), prompt, images in zip(steps, PROMPTS, _images()):
        messages = prepare_multimodal_messages(copy.deepcopy(prompt), images=images)
        out = processor.apply_chat_template([messages], tools=[lookup], tokenize=True, add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")
        inputs = {k: out[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
        assert torch.equal(group.prompt, out["input_ids"][0])
        assert any(not bool(m.all()) for m in group.loss_masks)  # tool results masked
        groups.append(ls.Group(prompt=group.prompt, responses=group.responses, rewards=group.rewards,
                               loss_masks=group.loss_masks, prompt_inputs=inputs))
    totals = ls.BatchTotals.of(groups)
    loss = sum(engine.step(g, trainer.longstraw_grpo, totals=totals).loss for g in groups)
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert_loss_close([h["loss"] for h in trainer.state.log_history if "loss" in h][0], loss, 1e-9)
    (got,) = grads.steps
    assert set(got) == set(want) and any(want[n].abs().sum() > 0 for n in want if ".visual." in n)
    assert_grads_close(got, want, 1e-9)
