"""The training loop's engine configuration: `longstraw train --memory-budget 80GiB` (or
`TrainConfig(memory_budget=...)`) fits the engine's `ExecConfig` to a memory budget with
`ls.fit_config`; without one the loop runs `ExecConfig(chunk_size=..., mode=...)` as before.

The fit is for the run's step: P = `prompt_tokens`, G = `group_size`, R = the task's
response budget (`task.response_tokens`), the arm's mode, on the run's preset model (its
real shapes and dtype). What the user set explicitly is pinned: `chunk_size` when given
(None leaves it to the fit), the mode (the arm), context parallelism (under torchrun).
The fit runs on a freshly built model before the warm start, so a budget that nothing
fits stops the run (`DoesNotFitError`, the CLI's exit 2) before any work.

What the budget counts is `fit_config`'s: what one `engine.step` adds above the loaded
model and its gradients, and the rollout's `engine.generate` before it (`generate=True`). The optimizer's state and the frozen reference copy (`log_kl`,
`beta`) are the loop's, like the model. The prompt states the loop holds besides the
step's own are added to the budget's load (`held_states`, `held_states_of`): the
rollouts' other prompts' states (`prompts_per_step` > 1 keeps one state per prompt until
the update), and with a reference (`log_kl`, the default, or `beta` > 0) one more: the
reference scores the samples with its own capture of the prompt while every rollout's
state is still held.
"""

from __future__ import annotations

import dataclasses

from longstraw.budget import fit_config
from longstraw.config import ExecConfig
from longstraw.train_config import TrainConfig, check_memory_budget

__all__ = ["TRAIN_CHUNK_SIZE", "SHOWN", "check_memory_budget", "engine_config", "held_states_of", "describe"]

TRAIN_CHUNK_SIZE = 1024
"""The loop's capture chunk (and exact mode's walk chunk) when neither `chunk_size` nor a
budget chooses one."""


def engine_config(cfg: TrainConfig, model, *, mode: str, context_parallel: bool) -> ExecConfig:
    """The policy engine's ExecConfig for run `cfg` on `model` (or a model of its shapes).

    Args:
        cfg: the run (its `memory_budget`, `chunk_size`, P, G and task).
        model: the run's model; only its config, dtype and parameter count are read.
        mode: "detached" or "exact" (the arm's).
        context_parallel: under torchrun, one prompt over every rank.

    Returns:
        `ExecConfig(chunk_size=cfg.chunk_size or TRAIN_CHUNK_SIZE, mode, context_parallel)`
        without a budget; with one, `fit_config`'s choice with the explicit options pinned.

    Raises:
        DoesNotFitError: nothing fits the budget (nothing has run yet).
    """
    if cfg.memory_budget is None:
        return ExecConfig(chunk_size=cfg.chunk_size or TRAIN_CHUNK_SIZE, mode=mode, context_parallel=context_parallel)
    fixed = {"context_parallel": context_parallel}
    if cfg.chunk_size is not None:
        fixed["chunk_size"] = cfg.chunk_size
    return fit_config(model, memory_budget=cfg.memory_budget, prompt_tokens=cfg.prompt_tokens, group=cfg.group_size,
                      response_tokens=cfg.task().response_tokens, mode=mode,
                      held_states=held_states_of(cfg), generate=True, **fixed)


def held_states_of(cfg: TrainConfig) -> int:
    """Prompt states alive beside the one a step (or the reference's scoring) works on:
    the other prompts' rollout states, plus, with a reference (`log_kl` or `beta` > 0),
    the reference's own capture made while all of them are held (`train._reference_kl`)."""
    return cfg.prompts_per_step - 1 + (1 if cfg.log_kl or cfg.beta > 0 else 0)


SHOWN = ("mode", "chunk_size", "branch_chunk_size", "recompute_layers", "offload_snapshots", "expert_parallel",
         "keep_graph_bytes", "state_device", "context_parallel")
"""The fields `describe` prints: the ones a fit chooses, and those it is told."""


def describe(config: ExecConfig) -> str:
    """`config`'s fitted fields (`SHOWN`) and any other it changes from `ExecConfig()`'s
    defaults, as `ExecConfig(mode='exact', chunk_size=1024, ...)`."""
    default = ExecConfig()
    names = [f.name for f in dataclasses.fields(config)
             if f.name in SHOWN or getattr(config, f.name) != getattr(default, f.name)]
    return "ExecConfig(" + ", ".join(f"{k}={getattr(config, k)!r}" for k in names) + ")"
