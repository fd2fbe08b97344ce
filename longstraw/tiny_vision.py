"""The tiny VLM's inputs, built offline: a processor, screenshots and ready prompt inputs.

`longstraw.tiny.tiny_vlm()` is a stock `Qwen3_5ForConditionalGeneration` with random
weights; a real checkpoint ships its processor, the tiny model has none. Here:

* `tiny_vlm_processor()`: HF's own `Qwen3VLProcessor` code (what `AutoProcessor` gives a
  Qwen3.5 / 3.6 checkpoint; here without the video processor, `ImagesProcessor`) over
  HF's `Qwen2VLImageProcessorPil` sized for `TINY_VISION`
  (patch 16, temporal patch 2, merge 2: a 32 x 32 pixel square is one image token) and a
  tokenizer built in code (`tiny_vlm_tokenizer`). Pass it as `processing_class` to
  `LongStrawGRPOTrainer`, or call its `apply_chat_template` for `Engine` inputs.
* `screenshots(n)`: n random RGB `PIL.Image`s (the dataset's `images` column).
* `screenshot_prompt(P, N, T)`: (prompt [P], prompt_inputs) of N screenshots of T image
  tokens each, built directly (no processor; random pixel rows), for benchmarks at large P.

The tokenizer's vocabulary fills the tiny VLM's 4,096 ids:

    ids 0..4079   the decimal numbers "0" .. "4079" (text is numbers: "12 7 3")
    4080..4086    <|endoftext|> (pad)  <|im_start|>  <|im_end|> (eos)  <unk>  user  assistant  system
    4090..4093    <|image_pad|>  <|video_pad|>  <|vision_start|>  <|vision_end|>   (TINY_VLM_TOKENS)

    rendering     <|im_start|>user <|vision_start|><|image_pad|>x6<|vision_end|> 12 7 <|im_end|><|im_start|>assistant

The chat template writes an image as Qwen's does (vision start, the image pad the
processor expands to the image's tokens, vision end); the generation prompt ends on the
text token `assistant`, as a prompt's last token must be text.

Needs Pillow (`pip install pillow`), as HF's PIL image processor does.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from longstraw.integrations.vlm_processor import ImagesProcessor
from longstraw.tiny import TINY_VISION, TINY_VLM_TOKENS

TEXT_WORDS = 4080
"""Ids 0 .. TEXT_WORDS - 1 are the decimal numbers."""

SPECIAL = {"<|endoftext|>": 4080, "<|im_start|>": 4081, "<|im_end|>": 4082, "<unk>": 4083,
           "<|image_pad|>": TINY_VLM_TOKENS["image_token_id"], "<|video_pad|>": TINY_VLM_TOKENS["video_token_id"],
           "<|vision_start|>": TINY_VLM_TOKENS["vision_start_token_id"],
           "<|vision_end|>": TINY_VLM_TOKENS["vision_end_token_id"]}
ROLES = {"user": 4084, "assistant": 4085, "system": 4086}
EOS, PAD = "<|im_end|>", "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}"
    "{%- if m['content'] is string -%}{{ ' ' + m['content'] + ' ' }}{%- else -%}"
    "{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c['type'] == 'text' -%}{{ ' ' + c['text'] + ' ' }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{%- endif -%}"
)
"""Qwen's layout, shortened: roles and numbers are words, an image is start + pad + end."""

# ----------------------------------------------------------------------------
# the processor


TinyVLMProcessor = ImagesProcessor
"""HF's `Qwen3VLProcessor` without its video processor (`integrations/vlm_processor.py`):
HF's video processors need torchvision, and LongStraw refuses videos anyway. Saved, it
names `Qwen3VLProcessor`; `longstraw grpo` loads such a folder back as this class."""


def tiny_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny VLM's word-level tokenizer (module doc): numbers, roles and Qwen's vision tokens."""
    vocab = {str(i): i for i in range(TEXT_WORDS)} | SPECIAL | ROLES
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = [AddedToken(t, special=True, normalized=False) for t in SPECIAL if t not in (EOS, PAD, "<unk>")]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token="<unk>",
                                        padding_side="left", additional_special_tokens=extra)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_vlm_processor(*, min_pixels: int = 32 * 32, max_pixels: int = 512 * 512) -> TinyVLMProcessor:
    """A processor for `longstraw.tiny.tiny_vlm()`, built offline (module doc).

    Args:
        min_pixels, max_pixels: the image processor's resize bounds (HF's `smart_resize`:
            each side rounded to a multiple of 32, the area kept within the bounds).
    """
    images = Qwen2VLImageProcessorPil(patch_size=TINY_VISION["patch_size"],
                                      temporal_patch_size=TINY_VISION["temporal_patch_size"],
                                      merge_size=TINY_VISION["spatial_merge_size"],
                                      size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                      return_tensors="pt")  # tensors even untensored, as HF's torchvision one
    return TinyVLMProcessor(image_processor=images, tokenizer=tiny_vlm_tokenizer(), chat_template=CHAT_TEMPLATE)


def screenshots(n: int, *, height: int = 64, width: int = 96, seed: int = 0) -> list:
    """n random RGB `PIL.Image`s of height x width (64 x 96: a (1, 4, 6) grid, 6 image tokens)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(n)]


# ----------------------------------------------------------------------------
# prompt inputs without a processor (benchmarks at large P)


def screenshot_prompt(prompt_tokens: int, images: int, image_tokens: int, *, seed: int = 0):
    """(prompt [P], prompt_inputs) for `tiny_vlm()`: `images` screenshots of `image_tokens`
    tokens (grid (1, 2a, 2b) with a * b = image_tokens, a the largest divisor <= sqrt)
    evenly spread, text tokens between them, text at the end; pixel rows random."""
    a = max(d for d in range(1, int(image_tokens ** 0.5) + 1) if image_tokens % d == 0)
    b = image_tokens // a
    text = prompt_tokens - images * (image_tokens + 2)
    if text < images + 1:
        raise ValueError(f"{images} images of {image_tokens} tokens (and their start / end tokens) do not fit in "
                         f"{prompt_tokens} prompt tokens with text between them; raise prompt_tokens")
    g = torch.Generator().manual_seed(seed)
    per = text // (images + 1)
    ids, types = [], []
    for k in range(images + 1):
        n = per if k < images else text - per * images
        ids.append(torch.randint(0, TEXT_WORDS, (n,), generator=g))
        types.append(torch.zeros(n, dtype=torch.long))
        if k < images:
            ids.append(torch.tensor([TINY_VLM_TOKENS["vision_start_token_id"]] + [TINY_VLM_TOKENS["image_token_id"]]
                                    * image_tokens + [TINY_VLM_TOKENS["vision_end_token_id"]]))
            types.append(torch.tensor([0] + [1] * image_tokens + [0]))
    width = 3 * TINY_VISION["temporal_patch_size"] * TINY_VISION["patch_size"] ** 2
    grid = torch.tensor([[1, 2 * a, 2 * b]] * images)  # (N, 3)
    pixels = torch.randn(int(grid.prod(-1).sum()), width, generator=g)  # (patches, C * t * p * p)
    return torch.cat(ids), dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=torch.cat(types))
