"""Images in the shared prompt: Qwen3.5's (and Qwen3.5-MoE's) vision tower and M-RoPE,
through Hugging Face's own `...ForConditionalGeneration` code.

A group's `prompt_inputs` are the prompt's non-text inputs as HF's processor names them
(`pixel_values`, `image_grid_thw`, `mm_token_type_ids`). Here:

* `check_prompt_inputs` refuses, before any work, inputs that HF would reject or
  silently misread: a shape or dtype that does not fit the tower, image tokens that do not
  match the grids (per image, in order), a prompt that ends on an image token, videos
  (not run yet), and images on a family without a supported tower.
* `VisionTower.encode` runs HF's own `get_image_features` (patch embedding, vision
  blocks, merger) once per image, whole, without grad, and HF's own `get_rope_index` over
  the prompt; the result (`state.vision.PromptImages`) rides on the prompt state, so the
  decoder chunks as usual and an image split across capture chunks changes nothing.
* `VisionTower.backprop` (exact mode, after the reverse walk): the walk has summed
  dLoss/d(image embeddings) over every chunk; each image's tower runs again with
  autograd and that gradient is pushed through it, so the tower's parameters get HF's
  full-backward gradient while only one image's graph is alive.
* Under context parallelism (docs/vision.md) the images are dealt over the ranks for the
  tower (`deal_images`): each rank runs its own, the rows are summed from zeroed tables,
  and a divided walk's partial row gradient is summed before each rank pushes its own
  images' part through the tower (the tower's partial parameter gradients join the
  walk's one sum).

Responses are text: an image (or video) placeholder token inside a response is refused
(`check_text_responses`), since nothing could supply its pixels.
"""

from __future__ import annotations

import itertools

import torch

from longstraw.errors import PromptInputsError, UnsupportedInputError
from longstraw.parallel.collectives import all_reduce_sum
from longstraw.state.vision import PromptImages

IMAGE_FAMILIES = ("qwen3_5", "qwen3_5_moe")
"""`config.model_type`s of the `...ForConditionalGeneration`s whose images LongStraw runs."""

NO_IMAGES_BECAUSE = {
    "gemma3": " (Gemma 3's image tokens attend to each other bidirectionally within an image, HF's "
              "token_type_ids mask; LongStraw's prompt attention is causal only)",
}
"""Why a family with a vision tower of its own runs no images here."""

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")


class VisionTower:
    """HF's vision tower, merger and M-RoPE index of one Qwen3.5 `...ForConditionalGeneration`."""

    def __init__(self, causal_lm):
        self.causal_lm = causal_lm
        self.model = causal_lm.model  # Qwen3_5Model: .visual, .get_image_features, .get_rope_index
        config = causal_lm.config
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        vc = config.vision_config
        self.merge = int(vc.spatial_merge_size)
        self.patch_width = int(vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2)
        self.hidden = int(vc.out_hidden_size)  # the merger's output: the text model's hidden size

    # --- the work ------------------------------------------------------------

    def image_embeds(self, inputs: dict, k: int, dtype: torch.dtype) -> torch.Tensor:
        """Image k's rows [n_k, d]: HF's `get_image_features` on its patches alone."""
        grid = inputs["image_grid_thw"]
        ends = grid.prod(-1).cumsum(0).tolist()
        a = 0 if k == 0 else ends[k - 1]
        device = self.model.visual.patch_embed.proj.weight.device
        pixels = inputs["pixel_values"][a:ends[k]].to(device)
        out = self.model.get_image_features(pixels, grid[k:k + 1].to(device), return_dict=True)
        return torch.cat(out.pooler_output, dim=0).to(dtype)  # HF casts to inputs_embeds' dtype

    def encode(self, prompt: torch.Tensor, inputs: dict, dtype: torch.dtype, device, cp=None) -> PromptImages:
        """The prompt's `PromptImages`: every image through the tower once (no grad) and
        HF's M-RoPE ids of prompt [P]. Under context parallelism (`cp`), each rank runs
        the images `deal_images` gives it and one all-reduce assembles the rows."""
        ids = prompt.to(device, torch.long)
        types = inputs["mm_token_type_ids"].reshape(1, -1).to(device)
        grid = inputs["image_grid_thw"]
        counts = (grid.prod(-1) // self.merge ** 2).tolist()
        spans = [(sum(counts[:k]), n) for k, n in enumerate(counts)]
        with torch.no_grad():
            positions, deltas = self.model.get_rope_index(ids[None], types, image_grid_thw=grid.to(device))
            embeds = self._all_embeds(inputs, spans, dtype, device, cp)
        image = ids == self.image_token_id
        rows = torch.full_like(ids, -1)
        rows[image] = torch.arange(int(image.sum()), device=device)
        return PromptImages(positions=positions[:, 0], rope_delta=int(deltas.reshape(-1)[0]), rows=rows,
                            embeds=embeds, spans=spans, trains=self.trains())

    def _all_embeds(self, inputs: dict, spans: list, dtype: torch.dtype, device, cp) -> torch.Tensor:
        """Every image's rows [N, d]. Under context parallelism each rank fills its own
        images' rows of a zeroed table and the ranks' tables are summed: every row is one
        rank's value plus zeros, so exactly what one process computes."""
        if cp is None or cp.world == 1:
            return torch.cat([self.image_embeds(inputs, k, dtype) for k in range(len(spans))], dim=0)
        out = torch.zeros(sum(n for _, n in spans), self.hidden, dtype=dtype, device=device)  # (N, d)
        for k in my_images(spans, cp):
            row, n = spans[k]
            out[row:row + n] = self.image_embeds(inputs, k, dtype)
        return all_reduce_sum(out, cp)

    def trains(self) -> bool:
        """Whether any parameter of the tower (merger included) takes a gradient."""
        return any(p.requires_grad for p in self.model.visual.parameters())

    def backprop(self, images: PromptImages, inputs: dict, cp=None) -> None:
        """Push the walk's dLoss/d(embeds) through each image's tower, one image at a time.

        `cp`: a divided reverse walk's context parallelism, where each rank's `grad` holds
        the part its own positions read: one all-reduce sums it, then each rank pushes the
        whole gradient of its own images (`deal_images`) through the tower, and the tower's
        parameter gradients are partial, summed over ranks with the walk's own (the caller
        runs this inside `partial_gradients`). None: `grad` is complete (one process, or a
        replicated walk) and every image runs here."""
        if images.grad is None or not self.trains():
            return
        mine = range(len(images.spans))
        if cp is not None and cp.world > 1:
            all_reduce_sum(images.grad, cp)  # (N, d): each rank's rows' share, summed
            mine = my_images(images.spans, cp)
        for k in mine:
            row, n = images.spans[k]
            with torch.enable_grad():
                out = self.image_embeds(inputs, k, images.embeds.dtype)  # (n, d)
            torch.autograd.backward(out, images.grad[row:row + n].to(out.dtype))
        if cp is not None and cp.world > 1:  # a rank dealt no image: zero partials, the layout every rank sums
            for p in self.model.visual.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)


def deal_images(spans: list, world: int) -> list[int]:
    """Context parallelism's deal of images over ranks for the tower: the rank of each
    image (`spans`: (first row, rows) per image), largest first onto the rank with the
    fewest rows so far (ties: the lower rank, then the earlier image). The same on every
    rank; the tower's work (patches ~ rows) is balanced to within one image."""
    load, owner = [0] * world, [0] * len(spans)
    for k in sorted(range(len(spans)), key=lambda k: (-spans[k][1], k)):
        owner[k] = min(range(world), key=lambda r: (load[r], r))
        load[owner[k]] += spans[k][1]
    return owner


def my_images(spans: list, cp) -> list[int]:
    """The images this rank runs through the tower, in prompt order (`deal_images`)."""
    return [k for k, r in enumerate(deal_images(spans, cp.world)) if r == cp.rank]


def vision_tower(causal_lm) -> VisionTower | None:
    """The model's `VisionTower` when its family's images are supported, else None."""
    model = getattr(causal_lm, "model", None)
    if getattr(causal_lm.config, "model_type", None) in IMAGE_FAMILIES and hasattr(model, "visual") \
            and hasattr(model, "get_rope_index"):
        return VisionTower(causal_lm)
    return None


# ----------------------------------------------------------------------------
# checks before any work


def _tensor(inputs: dict, name: str, *, floating: bool) -> torch.Tensor:
    value = inputs[name]
    if not isinstance(value, torch.Tensor):
        raise PromptInputsError(f"prompt_inputs[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
    if value.is_floating_point() != floating or value.is_complex() or value.dtype == torch.bool:
        want = "a floating-point" if floating else "an integer"
        raise PromptInputsError(f"prompt_inputs[{name!r}] must be {want} tensor, got dtype {value.dtype}")
    return value


def check_prompt_inputs(tower: VisionTower | None, model_type, prompt: torch.Tensor, inputs) -> None:
    """Refuse prompt inputs (`Group.prompt_inputs`) the model cannot run exactly, before
    any work. `tower`: the adapter's (None: the family runs no images)."""
    if inputs is None:
        return
    if not isinstance(inputs, dict):
        raise PromptInputsError(f"prompt_inputs must be a dict of tensors named as HF names them "
                                f"({', '.join(IMAGE_KEYS)}), got {type(inputs).__name__}")
    unknown = sorted(set(inputs) - set(IMAGE_KEYS) - set(VIDEO_KEYS))
    if unknown:
        raise PromptInputsError(f"prompt_inputs has unknown keys {unknown}; LongStraw takes {list(IMAGE_KEYS)}")
    if any(inputs.get(k) is not None for k in VIDEO_KEYS):
        raise UnsupportedInputError("videos in the prompt (pixel_values_videos / video_grid_thw) are not run yet; "
                                    "pass the frames as images, or drop them")
    if tower is None:
        why = NO_IMAGES_BECAUSE.get(model_type, "")
        raise UnsupportedInputError(
            f"model_type {model_type!r} runs text prompts only{why}: images run on {', '.join(IMAGE_FAMILIES)} "
            "...ForConditionalGeneration models (HF's vision tower and M-RoPE); drop prompt_inputs")
    missing = [k for k in IMAGE_KEYS if inputs.get(k) is None]
    if missing:
        raise PromptInputsError(f"prompt_inputs lacks {missing}: pass all of {list(IMAGE_KEYS)} (HF's processor "
                                "returns them together)")
    pixels = _tensor(inputs, "pixel_values", floating=True)
    grid = _tensor(inputs, "image_grid_thw", floating=False)
    types = _tensor(inputs, "mm_token_type_ids", floating=False)
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or bool((grid <= 0).any()):
        raise PromptInputsError(f"prompt_inputs['image_grid_thw'] must be [images, 3] of positive (t, h, w), got "
                                f"{grid.tolist() if grid.numel() <= 12 else tuple(grid.shape)}")
    if bool((grid[:, 1:] % tower.merge != 0).any()):
        raise PromptInputsError(f"image_grid_thw {grid.tolist()}: h and w must be multiples of the tower's "
                                f"spatial_merge_size {tower.merge}")
    patches = int(grid.prod(-1).sum())
    if pixels.dim() != 2 or tuple(pixels.shape) != (patches, tower.patch_width):
        raise PromptInputsError(f"prompt_inputs['pixel_values'] has shape {tuple(pixels.shape)}, but image_grid_thw "
                                f"needs [{patches}, {tower.patch_width}] (patches x channels * t * p * p)")
    _check_token_types(tower, prompt, types, grid)


def _check_token_types(tower: VisionTower, prompt: torch.Tensor, types: torch.Tensor, grid: torch.Tensor) -> None:
    """mm_token_type_ids must mark exactly the image tokens, one run per image of its size."""
    p = prompt.numel()
    if types.numel() != p or types.dim() not in (1, 2) or (types.dim() == 2 and types.shape[0] != 1):
        raise PromptInputsError(f"prompt_inputs['mm_token_type_ids'] has shape {tuple(types.shape)}; the prompt has "
                                f"{p} tokens: pass [{p}] or [1, {p}]")
    types = types.reshape(-1).cpu()
    if bool((types == 2).any()):
        raise UnsupportedInputError("mm_token_type_ids marks video tokens (2): videos are not run yet")
    if bool(((types != 0) & (types != 1)).any()):
        raise PromptInputsError(f"mm_token_type_ids must be 0 (text) or 1 (image), got {sorted(set(types.tolist()))}")
    image = prompt.cpu() == tower.image_token_id
    if not torch.equal(image, types == 1):
        raise PromptInputsError(f"mm_token_type_ids marks {int((types == 1).sum())} image tokens but the prompt holds "
                                f"{int(image.sum())} image_token_id={tower.image_token_id} tokens, or at other places; "
                                "they must mark the same tokens")
    runs = [len(list(g)) for key, g in itertools.groupby(types.tolist()) if key == 1]
    want = (grid.prod(-1) // tower.merge ** 2).tolist()
    if runs != want:
        raise PromptInputsError(f"the prompt's image token runs have {runs} tokens but image_grid_thw gives {want} "
                                f"(t * h * w / spatial_merge_size^2 per image, in order)")
    if bool(types[-1] != 0):
        raise PromptInputsError("the prompt's last token is an image token; end the prompt with text (a chat "
                                "template's assistant header): the last prompt token starts every branch")


def placeholder_ids(tower: VisionTower | None) -> tuple:
    """The image and video placeholder ids `generate` never samples (none without a tower)."""
    return () if tower is None else (tower.image_token_id, tower.video_token_id)


def check_text_responses(tower: VisionTower | None, responses, what: str = "group.responses") -> None:
    """Refuse image or video placeholder tokens in responses: responses are text (an image
    mid-episode belongs in the next prompt)."""
    if tower is None:
        return
    for i, r in enumerate(responses):
        bad = (r == tower.image_token_id) | (r == tower.video_token_id)
        if bool(bad.any()):
            raise UnsupportedInputError(
                f"{what}[{i}] holds an image/video placeholder token ({int(r[bad][0])}) at index "
                f"{int(bad.nonzero()[0, 0])}: responses are text, images run in the prompt only; start a new "
                "prompt that holds the screenshot")
