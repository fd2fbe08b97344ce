"""The engine's check of a prompt's non-text inputs (`Group.prompt_inputs`, `generate(...,
prompt_inputs=)`): what the model's adapter refuses (`models/vision.py`). Capture,
validation and rollouts call it before any work. Every engine configuration runs images:
under context parallelism and with state offload (the image rows stay on the model's
device) too (docs/vision.md)."""

from __future__ import annotations

import torch


def check_inputs(engine, prompt: torch.Tensor, prompt_inputs, responses=(), what: str = "group.responses") -> None:
    """Refuse a prompt's non-text inputs the model cannot run (`Adapter.check_inputs`)."""
    engine.adapter.check_inputs(prompt, prompt_inputs, responses, what)
