"""`longstraw.tiny_vision`: the tiny VLM's offline processor gives inputs the engine and HF
both take, and docs/vision.md's snippet runs as pasted (extracted from the page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from longstraw.errors import PromptInputsError
from longstraw.models.vision import VisionTower, check_prompt_inputs
from longstraw.tiny import TINY_VLM_TOKENS, tiny_vlm
from longstraw.tiny_vision import screenshot_prompt, screenshots, tiny_vlm_processor

VISION_MD = Path(__file__).resolve().parents[1] / "docs" / "vision.md"
IMAGE = TINY_VLM_TOKENS["image_token_id"]


def _two_images():
    processor = tiny_vlm_processor()
    first, second = screenshots(2, height=64, width=96)
    second = second.resize((64, 32))  # another grid: (1, 2, 4)
    messages = [{"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "12 7"},
                                             {"type": "image", "image": second}, {"type": "text", "text": "3"}]}]
    return processor, processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                    return_dict=True, return_tensors="pt")


def test_the_processor_writes_each_image_as_its_grid_of_tokens():
    processor, inputs = _two_images()
    ids = inputs["input_ids"][0]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 4]]
    assert int((ids == IMAGE).sum()) == 6 + 2  # t * h * w / merge^2 each
    assert torch.equal(inputs["mm_token_type_ids"][0], (ids == IMAGE).long())
    assert processor.tokenizer.decode(ids[-2:]) == "<|im_start|> assistant"  # the prompt ends on text
    assert processor.tokenizer.eos_token_id == 4082 and processor.image_token_id == IMAGE


def test_the_processors_inputs_are_what_the_engine_and_hf_take():
    """The engine's checks pass them, and HF's own forward with them differs from the
    forward without the pixels' rows (the images are read)."""
    _, inputs = _two_images()
    prompt = inputs["input_ids"][0]
    prompt_inputs = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    model = tiny_vlm()
    check_prompt_inputs(VisionTower(model), "qwen3_5", prompt, prompt_inputs)
    with torch.no_grad():
        logits = model(input_ids=prompt[None], **prompt_inputs).logits
        other = model(input_ids=prompt[None], **{**prompt_inputs, "pixel_values": prompt_inputs["pixel_values"] + 1})
    assert not torch.allclose(logits, other.logits)
    keep = torch.ones_like(prompt, dtype=torch.bool)
    keep[int((prompt == IMAGE).nonzero()[0])] = False  # the first image one token short of its grid
    short = {**prompt_inputs, "mm_token_type_ids": prompt_inputs["mm_token_type_ids"][:, keep]}
    with pytest.raises(PromptInputsError):
        check_prompt_inputs(VisionTower(model), "qwen3_5", prompt[keep], short)


def test_screenshot_prompt_lays_out_images_and_text():
    prompt, inputs = screenshot_prompt(100, 3, 6)
    assert prompt.numel() == 100 and int((prompt == IMAGE).sum()) == 18
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]] * 3
    assert prompt[-1] != IMAGE
    with pytest.raises(ValueError, match="do not fit"):
        screenshot_prompt(20, 3, 6)


@pytest.mark.slow  # ~5 s idle, 28 s on the loaded 2-core machine: a generate and an exact step
def test_the_vision_page_snippet_runs_as_pasted(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", VISION_MD.read_text(), re.S | re.M)
    assert blocks, "docs/vision.md has no Python block"
    exec(compile(blocks[0], "docs/vision.md python block 0", "exec"), {"__name__": "vision_md_block_0"})
    out = capsys.readouterr().out
    assert float(re.search(r"tower grad norm ([0-9.e+-]+)", out).group(1)) > 0
