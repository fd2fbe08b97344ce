"""The planner's images in the prompt (`--images N --image-tokens T`, `docs/vision.md`):
the vision tower's parameters (and, trained in full, their gradients and Adam state), the
image rows the prompt state keeps, and the largest image's working set. Torch-free.

What the engine does (`models/vision.py`): capture runs HF's tower + merger once per
image, whole, without grad, and keeps the merged rows [N * T, d] and the prompt's M-RoPE
table (int64 [3, P]) and row map (int64 [P]); exact mode sums dLoss/d(rows) over the walk
(in the accumulation dtype) and then runs each image's tower again with autograd and
backpropagates it, one image at a time. So the tower's activations are a transient of
one image, never of all N: the "vision" phase below.

The tower's shape comes from the config's `vision_config` when it has one, else Qwen3.5 /
3.6's (HF's `Qwen3_5VisionConfig` defaults: 27 blocks of width 1152, MLP 4304, 16 heads,
16 x 16 patches over 2 frames, 2 x 2 merge, 2304 learned positions; the presets carry the
text model only).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Basis

QWEN3_5_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                     temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304)
"""HF's `Qwen3_5VisionConfig` defaults (transformers 5.23): the tower of Qwen3.5-27B."""

IMAGE_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
"""The families whose images the engine runs (`models/vision.IMAGE_FAMILIES`; a text config
of theirs plans as the text model inside its ...ForConditionalGeneration)."""


@dataclass(frozen=True)
class VisionPlan:
    """Images in the prompt, per rank: under context parallelism every rank holds the
    tower, the rows (and their gradient) whole and runs whole images, its largest included
    (the engine deals images over ranks, `models/vision.deal_images`), so the figures do not
    depend on W.

    Fields:
        images / image_tokens: N images of (at most) T merged tokens each.
        params: the tower's parameters (patch embedding, learned positions, blocks, merger).
        param_bytes / grad_bytes / optimizer_bytes: its weights, and when trained (exact
            mode, in full) its gradients and Adam state (LoRA: the tower is frozen; detached:
            the rows are constants, no backward reaches it, its `.grad` stays None and Adam
            keeps no state for it).
        rows_bytes: what the prompt state keeps for the images: rows [N * T, d], the
            M-RoPE table and the row map (int64, per prompt token).
        rows_grad_bytes: exact mode with a trained tower: dLoss/d(rows) [N * T, d] in the
            accumulation dtype.
        nograd_working: capture's tower forward of the largest image.
        graph_working: exact mode with a trained tower: one image's forward graph plus
            one block's moment in its backward (0 otherwise).
        assumptions: the report lines these rest on.
        graph: exact mode with a trained tower: one image's forward graph alone (0 otherwise).
    """

    images: int
    image_tokens: int
    params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    rows_bytes: float
    rows_grad_bytes: float
    nograd_working: float
    graph_working: float
    assumptions: tuple
    graph: float = 0.0

    @property
    def static(self) -> float:
        """Held for the whole step: the tower's weights (+ grads, Adam), the rows (+ grads)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.rows_bytes + self.rows_grad_bytes

    @property
    def working(self) -> float:
        """The vision phase's working set beyond the static memory."""
        return max(self.nograd_working, self.graph_working)


def tower_shape(cfg: dict) -> dict:
    """The tower's shape: the config's `vision_config` over Qwen3.5's defaults."""
    return {**QWEN3_5_TOWER, **{k: v for k, v in (cfg.get("vision_config") or {}).items() if k in QWEN3_5_TOWER}}


def tower_parameters(v: dict, out_hidden: int) -> int:
    """Parameters of HF's Qwen3.5 vision tower of shape `v` whose merger outputs `out_hidden`."""
    h, i, m2 = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * h + h  # Conv3d + bias
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)  # 2 LayerNorms, qkv, proj, MLP
    merger = 2 * h + (h * m2) ** 2 + h * m2 + h * m2 * out_hidden + out_hidden  # LayerNorm, fc1, fc2
    return patch + v["num_position_embeddings"] * h + v["depth"] * block + merger


def plan_vision(s: Basis) -> VisionPlan | None:
    """The images' figures, or None for a text prompt (`PlanConfig.images == 0`)."""
    c = s.config
    if not c.images:
        return None
    v, d = tower_shape(s.cfg), s.arch.hidden
    h, i, m2 = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"] ** 2
    params = tower_parameters(v, d)
    trained = not c.lora_rank and s.exact  # detached, the rows are constants: no gradient reaches the tower
    adam = 8 + (4 if s.b < 4 else 0)
    n = c.image_tokens * m2  # the largest image's patches
    pixel_width = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    # its pixels (copied to the device / cast to the tower's dtype), and one block's widest moment: in
    # attention the block input, its norm and the position-embedded input, qkv, the rotated q / k, the
    # output (~11h) and the rotary cos / sin (2 x head dim); in the MLP the residual, norm, fc1 and act (5h + i).
    # Found on the tiny VLM (one 4,096-patch image, fp32): 752 elements per patch alive, 672 + 64 in attention
    attention_moment = 11 * h + 2 * (h // v["num_heads"])
    moment = n * max(attention_moment, 5 * h + i) * s.b
    nograd = n * pixel_width * s.b + moment
    per_block_saved = 11 * h + 2 * i  # norms, qkv, rotated q / k, attention out, proj in, MLP in / mid / act
    # exact: the image's forward graph (its pixels included) and, in its backward, one block's moment
    graph = n * (v["depth"] * per_block_saved + pixel_width + 3 * h) * s.b if trained else 0.0
    rows = c.images * c.image_tokens * d * s.b + s.P * (3 + 1) * 8
    assumptions = (
        f"images: {c.images} of <= {c.image_tokens:,} merged tokens (= {n:,} patches) through a vision tower of "
        f"{v['depth']} blocks, width {h}, MLP {i} ({params / 1e6:,.1f}M parameters"
        + ("; trained" if trained else "; frozen under LoRA" if c.lora_rank else "; no gradient in detached mode")
        + "); the tower runs once per image at capture, and "
        + ("again with autograd after the walk (exact mode), one image at a time" if trained and s.exact else
           "gets no backward"),
        "images: the prompt state keeps the merged rows [N * T, d] in the compute dtype plus an int64 M-RoPE table "
        "and row map (32 B per prompt token); the vision phase's working set (one image's activations, flash-style "
        "attention inside the tower) is an estimate, not measured on a GPU",
    ) + ((f"images under context parallelism: every rank holds the rows whole and runs ~1/{c.gpus} of the images "
          "through the tower; the all-reduce of the rows at capture (and of their gradient after an exact walk) is "
          "not in the traffic figures",) if c.gpus > 1 else ())
    return VisionPlan(images=c.images, image_tokens=c.image_tokens, params=params,
                      param_bytes=params * s.b, grad_bytes=params * s.b if trained else 0.0,
                      optimizer_bytes=params * adam if trained else 0.0, rows_bytes=rows,
                      rows_grad_bytes=c.images * c.image_tokens * d * s.acc if s.exact and trained else 0.0,
                      nograd_working=nograd, graph_working=graph + moment if trained else 0.0,
                      assumptions=assumptions, graph=graph)


def vision_report(v: VisionPlan | None) -> dict:
    """The report's image figures, bytes per rank (zeros for a text prompt)."""
    if v is None:
        return {"vision_param_bytes": 0, "vision_static_bytes": 0, "vision_rows_bytes": 0, "vision_working_bytes": 0,
                "vision_parameters": 0}
    return {"vision_param_bytes": int(v.param_bytes), "vision_static_bytes": int(v.static),
            "vision_rows_bytes": int(v.rows_bytes + v.rows_grad_bytes), "vision_working_bytes": int(v.working),
            "vision_parameters": v.params}
