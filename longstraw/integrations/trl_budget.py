"""`LongStrawGRPOTrainer(longstraw_memory_budget=...)`: the trainer's engine configuration
fitted to a memory budget with `ls.fit_config`, at construction, before any rollout.

The step fitted is the trainer's, its rollout (`engine.generate`) included: G = `num_generations`, R = `max_completion_length`,
P = `longstraw_prompt_tokens` (default: the longest prompt the model can take with a full
completion, `max_position_embeddings - max_completion_length`), the mode of
`longstraw_config`. A prompt longer than the P fitted is refused before its capture
(`check_prompt_tokens`), since the budget was not planned for it.

What is pinned: every field of `longstraw_config` that differs from `ExecConfig()`'s
default (so `ExecConfig(chunk_size=512, mode="exact")` keeps its chunk and mode, and the
search chooses the rest), and context parallelism over the C ranks of a prompt
(`longstraw_context_parallel_size`). Held states: with `longstraw_keep_states=True` (or
tools) every prompt group of a generation batch keeps its state until its update, so the
other prompts' states (`per_device_train_batch_size * steps_per_generation /
num_generations - 1` per rank) are counted inside the budget (`fit_config(held_states=)`).
Outside it, as for `fit_config`: the model, its gradients, the optimizer, a reference
model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings

from ..budget import fit_config
from ..config import ExecConfig
from longstraw import fit_advice
from ..errors import ConfigError, DoesNotFitError
from ..shapes import planner_config

logger = logging.getLogger(__name__)

__all__ = ["pinned_fields", "held_prompt_states", "fitted_config", "check_prompt_tokens"]


def pinned_fields(config: ExecConfig) -> dict:
    """The fields of `config` that differ from `ExecConfig()`'s defaults (what the user set)."""
    default = ExecConfig()
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}


def held_prompt_states(args, keep_states: bool, tools: bool) -> int:
    """Other prompt states alive while one group steps: the rest of a generation batch's
    prompts on this rank when states are kept (or tools hold them), else 0."""
    if not (keep_states or tools):
        return 0
    prompts = math.ceil(args.per_device_train_batch_size * args.steps_per_generation / args.num_generations)
    return max(0, prompts - 1)


def fitted_config(policy, config: ExecConfig, *, memory_budget, prompt_tokens: int | None, args,
                  context_parallel: bool, process_group, held_states: int) -> tuple[ExecConfig, int | None]:
    """`fit_config` for the trainer's step on `policy` (logged at INFO); without a budget,
    `(config, None)` unchanged.

    Args:
        policy: the unwrapped policy model (PEFT-wrapped too).
        config: the user's `longstraw_config`; its non-default fields are pinned.
        memory_budget: as `fit_config` (bytes, "80GiB", or on CUDA "auto"); None: no fit.
        prompt_tokens: P to fit for; None: `max_position_embeddings - max_completion_length`.
        args: the trainer's `trl.GRPOConfig` (num_generations, max_completion_length).
        context_parallel: C > 1 ranks share a prompt (over `process_group`).
        process_group: the context-parallel group (None: one process).
        held_states: other prompt states alive during a step (`held_prompt_states`).

    Returns:
        (the ExecConfig, P it was fitted for or None).

    Raises:
        DoesNotFitError: nothing fits (raised at construction, before any rollout).
        ConfigError: a bad budget, or no P to fit for.
    """
    if memory_budget is None:
        return config, None
    if prompt_tokens is None:
        limit = planner_config(policy).get("max_position_embeddings")
        if not limit or limit <= args.max_completion_length:
            raise ConfigError("longstraw_memory_budget needs the longest prompt to fit for: pass "
                              "longstraw_prompt_tokens=P (the model's config has no usable max_position_embeddings)")
        prompt_tokens = int(limit) - args.max_completion_length
    if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ConfigError(f"longstraw_prompt_tokens must be an int >= 1, got {prompt_tokens!r}")
    fixed = pinned_fields(config)
    mode = fixed.pop("mode", config.mode)
    fixed["context_parallel"] = context_parallel
    try:
        fitted = fit_config(policy, memory_budget=memory_budget, prompt_tokens=prompt_tokens,
                            group=args.num_generations, response_tokens=args.max_completion_length, mode=mode,
                            held_states=held_states, generate=True, process_group=process_group, **fixed)
    except DoesNotFitError as exc:  # its changes in the trainer's arguments
        raise fit_advice.again(exc, "trl", prefix=f"LongStrawGRPOTrainer(longstraw_memory_budget={memory_budget!r}): ",
                               suffix="; or lower longstraw_prompt_tokens, num_generations or max_completion_length") from None
    logger.info("LongStrawGRPOTrainer: memory budget %r at P = %d fits %s", memory_budget, prompt_tokens, fitted)
    return dataclasses.replace(fitted, context_parallel=False), prompt_tokens  # the trainer sets it per mesh


def check_prompt_tokens(prompt_tokens: int, fitted: int | None, memory_budget, prompt_inputs=None) -> None:
    """A `ConfigError` before the capture of a prompt longer than the P the budget was fitted
    for; a prompt with images (`prompt_inputs`) warns (`warn_unfitted_images`)."""
    warn_unfitted_images(prompt_inputs, memory_budget)
    if fitted is not None and prompt_tokens > fitted:
        raise ConfigError(f"a prompt of {prompt_tokens:,} tokens is longer than the {fitted:,} that "
                          f"longstraw_memory_budget={memory_budget!r} was fitted for; pass "
                          f"longstraw_prompt_tokens >= {prompt_tokens:,} (or truncate the prompts)")


class UnfittedImagesWarning(UserWarning):
    """`longstraw_memory_budget` was fitted for text prompts and a prompt brings images."""


def warn_unfitted_images(prompt_inputs, memory_budget) -> None:
    """Warn (once per process, Python's default filter) when a prompt with images runs under
    a budget the trainer fitted at construction, before it saw the dataset: its image
    placeholder tokens are in P, but the vision tower's activations and, in exact mode, the
    image rows' gradients are not (`ls.fit_config(images=...)` plans them from Python)."""
    if memory_budget is not None and prompt_inputs and "pixel_values" in prompt_inputs:
        warnings.warn(f"longstraw_memory_budget={memory_budget!r} was fitted for text prompts: the vision tower's "
                      "activations and the image rows' gradients are not in it; leave headroom, or fit the "
                      "ExecConfig from Python with ls.fit_config(..., prompt_inputs=...) and pass it as "
                      "longstraw_config (without longstraw_memory_budget)", UnfittedImagesWarning, stacklevel=2)

