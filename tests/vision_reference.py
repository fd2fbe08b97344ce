"""References for prompts with images (issue 39): a tiny stock Qwen3.5
`...ForConditionalGeneration` (vision tower + merger + hybrid text model), prompts that
hold screenshots, and HF's own forward over prompt + response with the same pixels.

The text config gives the full-attention layers' RoPE all three M-RoPE axes
(`mrope_section` [2, 1, 1] over head_dim 8, rotary factor 1): with HF's default
[11, 11, 10] on a tiny head only the temporal axis would rotate anything, and a wrong
height / width position could not show.
"""

from __future__ import annotations

import copy

import torch
import transformers

from tests.reference import _HYBRID, _out_of_place_linear_cache, gather_logprobs

IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93
"""The tiny config's special ids (inside the 97-token vocabulary); text tokens are < 90."""

_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32, patch_size=2,
               temporal_patch_size=1, spatial_merge_size=2, num_position_embeddings=16)
_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0, mrope_section=[2, 1, 1])


def tiny_vlm(*, moe: bool = False, dtype=torch.float64, seed: int = 0, **vision):
    """A stock HF Qwen3.5 (or Qwen3.5-MoE) `...ForConditionalGeneration`, eval mode,
    its 1-D parameters moved off HF's constant initial values."""
    text = {**_HYBRID, "rope_parameters": _ROPE}
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=16)
    config_cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    config = config_cls(text_config=text, vision_config={**_VISION, **vision}, image_token_id=IMAGE,
                        video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = config.vision_config._attn_implementation = "sdpa"
    config.text_config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def image_prompt(layout, *, seed: int = 0, grids=None, merge: int = 2, patch_width: int = 12,
                 dtype=torch.float64):
    """(prompt [P], prompt_inputs) from a layout: an int n is n random text tokens, "img"
    one image of the next grid (t, h, w) in `grids` (default (1, 4, 4) each), wrapped in
    vision start / end tokens as HF's chat template writes it."""
    g = torch.Generator().manual_seed(seed)
    grids = list(grids) if grids is not None else [(1, 4, 4)] * sum(1 for x in layout if x == "img")
    ids, types, used = [], [], []
    for item in layout:
        if item == "img":
            t, h, w = grids[len(used)]
            used.append((t, h, w))
            n = t * h * w // merge ** 2
            ids += [VISION_START] + [IMAGE] * n + [VISION_END]
            types += [0] + [1] * n + [0]
        else:
            ids += torch.randint(0, IMAGE, (item,), generator=g).tolist()
            types += [0] * item
    grid = torch.tensor(used, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_width, generator=g, dtype=torch.float64).to(dtype)
    return torch.tensor(ids), dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=torch.tensor(types))


def text_responses(lengths, *, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, IMAGE, (n,), generator=g) for n in lengths]


def _hf_inputs(inputs: dict, types: torch.Tensor) -> dict:
    return dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                mm_token_type_ids=types[None])


def hf_vlm_full_logprobs(model, prompt, response, inputs, temperature=1.0):
    """HF's one forward over prompt + response with the prompt's pixels: [R] log-probs."""
    ids = torch.cat([prompt, response])
    types = torch.cat([inputs["mm_token_type_ids"].reshape(-1), torch.zeros_like(response)])
    logits = model(input_ids=ids[None], logits_to_keep=response.numel() + 1, **_hf_inputs(inputs, types)).logits
    return gather_logprobs(logits[0, :-1], response, temperature)


def hf_vlm_cached_logprobs(model, prompt, response, inputs, temperature=1.0):
    """HF's cached continuation: prompt[:-1] with its pixels under no_grad into HF's cache
    (which sets the model's `rope_deltas`), then [prompt[-1]] + response[:-1] with
    autograd on a copy of that cache, positioned from those deltas."""
    with torch.no_grad():
        types = inputs["mm_token_type_ids"].reshape(-1)[:-1]
        cache = model(input_ids=prompt[:-1][None], use_cache=True, **_hf_inputs(inputs, types)).past_key_values
    cache = _out_of_place_linear_cache(copy.deepcopy(cache))
    ids = torch.cat([prompt[-1:], response[:-1]])
    logits = model(input_ids=ids[None], past_key_values=cache, use_cache=True).logits[0]
    return gather_logprobs(logits, response, temperature)


def hf_vlm_greedy(model, prompt, inputs, steps: int):
    """HF's `generate(do_sample=False)` with the prompt's pixels, exactly `steps` tokens."""
    saved = copy.deepcopy(model.generation_config), model.config.text_config.eos_token_id
    model.generation_config.eos_token_id = model.config.text_config.eos_token_id = None
    try:
        out = model.generate(input_ids=prompt[None], max_new_tokens=steps, do_sample=False,
                             **_hf_inputs(inputs, inputs["mm_token_type_ids"].reshape(-1)))[0, prompt.numel():]
    finally:
        model.generation_config, model.config.text_config.eos_token_id = saved
    assert out.numel() == steps
    return out
