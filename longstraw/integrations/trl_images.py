"""Images through `LongStrawGRPOTrainer`: TRL's batched processor outputs, cut into each
prompt group's `prompt_inputs` (docs/trl.md, "Images").

TRL 1.16's VLM GRPO takes a dataset with an `image` or `images` column and a processor as
`processing_class`; `_tokenize_prompts` runs the processor's `apply_chat_template` over the
generation batch's rows (each prompt num_generations times in a row) and hands
`_generate_single_turn` the rows' images and one dict of fields for the whole batch:

    pixel_values       [patches of every row's images, C * t * p * p]   (numpy or tensor)
    image_grid_thw     [images of every row, 3]                          (t, h, w) per image
    mm_token_type_ids  one list per row (1 at image tokens), or [rows, P] left-padded

`group_prompt_inputs` cuts out each group's first row: its images' patches and grids, its
token types, as the engine's `prompt_inputs` (`models/vision.py` checks them before any
work). The engine then runs the tower once per image at the group's one capture, and in
exact mode pushes the walk's image-row gradient through it after the update.
"""

from __future__ import annotations

import itertools

import torch

from ..errors import ConfigError

FIELDS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
"""The processor's fields the engine takes (Qwen3.5 / 3.6's `Qwen3VLProcessor`)."""


def _tensor(value) -> torch.Tensor:
    """A numpy array, a tensor or a list of per-row arrays as one tensor."""
    if isinstance(value, torch.Tensor):
        return value
    import numpy as np

    return torch.from_numpy(np.asarray(value))


def group_prompt_inputs(prompt_ids: list, images, fields: dict, num_generations: int) -> list[dict | None]:
    """Each group's `prompt_inputs` (None: a prompt without images), from TRL's batch.

    Args:
        prompt_ids: the rows' prompt ids (each group's rows equal, num_generations in a row).
        images: the rows' image lists (None, or None for a row without images), as TRL
            passes them to `_generate_single_turn`.
        fields: TRL's `multimodal_fields` for those rows (module doc).
        num_generations: G, rows per group.
    """
    groups = range(0, len(prompt_ids), num_generations)
    if images is None or not fields:
        return [None for _ in groups]
    unknown = sorted(set(fields) - set(FIELDS) - {"num_images"})
    if unknown:
        raise ConfigError(f"LongStrawGRPOTrainer: the processor returned {unknown}, which the engine does not take "
                          f"(it takes {list(FIELDS)}: Qwen3.5 / 3.6 images; pass videos as frames, i.e. images)")
    counts = [len(row) if row else 0 for row in images]  # images per row
    grid = _tensor(fields["image_grid_thw"]).to(torch.long).reshape(-1, 3)  # (images, 3)
    pixels = _tensor(fields["pixel_values"])  # (patches, C * t * p * p)
    if grid.shape[0] != sum(counts) or pixels.shape[0] != int(grid.prod(-1).sum()):
        raise ConfigError(f"LongStrawGRPOTrainer: the processor gave {grid.shape[0]} image grids and "
                          f"{pixels.shape[0]} patch rows for {sum(counts)} images; expected one grid per image")
    first_image = [0, *itertools.accumulate(counts)]
    first_patch = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
    out = []
    for start in groups:
        if counts[start] == 0:
            out.append(None)
            continue
        a, b = first_image[start], first_image[start + 1]
        types = _tensor(fields["mm_token_type_ids"][start]).to(torch.long).reshape(-1)
        out.append(dict(pixel_values=pixels[first_patch[a]:first_patch[b]], image_grid_thw=grid[a:b],
                        mm_token_type_ids=types[types.numel() - len(prompt_ids[start]):]))  # left padding cut off
    return out
