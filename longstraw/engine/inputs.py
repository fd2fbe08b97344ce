"""The engine's check of a prompt's non-text inputs (`Group.prompt_inputs`, `generate(...,
prompt_inputs=)`): what the model's adapter refuses (`models/vision.py`), and what this
engine's configuration does not run with images yet. Capture, validation and rollouts
call it before any work."""

from __future__ import annotations

import torch

from longstraw.errors import UnsupportedInputError


def check_inputs(engine, prompt: torch.Tensor, prompt_inputs, responses=(), what: str = "group.responses") -> None:
    """Refuse a prompt's non-text inputs the model (`Adapter.check_inputs`) or this engine
    cannot run: images with state offload are not run yet (under context parallelism
    they run: docs/vision.md)."""
    engine.adapter.check_inputs(prompt, prompt_inputs, responses, what)
    if prompt_inputs is None:
        return
    if engine.config.offloads_state():
        raise UnsupportedInputError("images in the prompt with state offload (ExecConfig(state_device='cpu')) are "
                                    "not run yet; keep the state on the model's device")

