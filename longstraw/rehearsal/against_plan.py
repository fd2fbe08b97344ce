"""`longstraw plan ... --rehearse`: the planner's figures beside a rehearsal's, phase by phase.

The planner (`longstraw.plan.estimate`) estimates a step's peak per rank analytically; a
rehearsal (`ls.rehearse`) runs the engine's own step on fake tensors at the same size and
counts its live tensors. This module turns a `PlanConfig` into the rehearsal of the same
step and sets the two side by side.

What is compared: a rehearsal runs one step from `zero_grad(set_to_none=True)` with no
optimizer state, so the planner is asked for the same step (`grads_during_capture=False`)
and its optimizer state is taken off every figure (peak and phases). The planner's
"recompute" phase is the rehearsal's "walk" (exact mode's reverse walk).

Rehearsed so far: one rank (`--gpus 1`), full training in the compute dtype (no LoRA,
no quantised weights), no tree, no images, the state on the device. Anything else is
refused with `ConfigError` before a fake model is built.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from longstraw.config import ExecConfig
from longstraw.errors import ConfigError
from longstraw.plan.arch import load_model_config
from longstraw.plan.config import PlanConfig
from longstraw.plan.estimate import estimate
from longstraw.plan.fit import exec_config
from longstraw.rehearsal.run import Rehearsal, rehearse

PHASE_OF_PLANNER = {"recompute": "walk"}
"""Planner phase name -> rehearsal phase name, where they differ."""

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}


def hf_config(model) -> transformers.PretrainedConfig:
    """The HF config of a planner model (preset name, config.json path or dict): the text
    model's config where the family has one (`qwen3_5` -> `qwen3_5_text`)."""
    _, cfg, _ = load_model_config(model)
    outer = cfg.get("model_type")
    cfg = dict(cfg["text_config"]) if isinstance(cfg.get("text_config"), dict) else dict(cfg)
    model_type = cfg.pop("model_type", None) or (f"{outer}_text" if outer else None)
    cfg.pop("torch_dtype", None)
    if model_type is None:
        raise ConfigError(f"rehearse: the config of {model!r} has no model_type")
    text = f"{model_type}_text"
    return transformers.AutoConfig.for_model(text if text in CONFIG_MAPPING else model_type, **cfg)


def refuse_unrehearsed(c: PlanConfig) -> None:
    """`ConfigError` for a planned configuration a rehearsal cannot run yet (before any work)."""
    unsupported = {"--gpus > 1 (world_size > 1 is not rehearsed yet)": c.gpus > 1,
                   "--lora-rank": c.lora_rank is not None, "--weight-dtype": c.weight_dtype not in (None, c.dtype),
                   "--tree": c.tree is not None, "--images": bool(c.images), "--offload-state": c.offload_state,
                   "--shard-params": c.shard_params, "--expert-parallel": c.expert_parallel,
                   "--score-passes": bool(c.score_passes), "--data-parallel > 1": c.data_parallel > 1,
                   "--generate": c.generate}
    bad = [flag for flag, on in unsupported.items() if on]
    if bad:
        raise ConfigError(f"longstraw plan --rehearse: not rehearsed yet: {', '.join(bad)}; drop them to rehearse "
                          "the rest (docs/rehearse.md)")


def rehearsal_exec_config(c: PlanConfig) -> ExecConfig:
    """The `ExecConfig` of planned configuration `c` (one rank)."""
    fields = {k: v for k, v in exec_config(c).items() if k not in ("context_parallel", "expert_parallel")}
    if fields.get("recompute_layers") is None:
        fields.pop("recompute_layers")
    if fields.get("offload_snapshots") is None:
        fields.pop("offload_snapshots")
    return ExecConfig(**fields)


def rehearse_plan(model, c: PlanConfig, *, steps: int = 1) -> Rehearsal:
    """Rehearse the step planned by (`model`, `c`) on one rank on the CPU branches."""
    refuse_unrehearsed(c)
    dtype = DTYPES.get(str(c.dtype or "bf16").lower())
    if dtype is None:
        raise ConfigError(f"longstraw plan --rehearse: dtype {c.dtype!r} is not one of {', '.join(DTYPES)}")
    return rehearse(hf_config(model), rehearsal_exec_config(c), prompt_tokens=c.prompt_tokens, group=c.group,
                    response_tokens=c.response_tokens, device="cpu", dtype=dtype, steps=steps)


def planned_as_rehearsed(model, c: PlanConfig) -> dict:
    """The planner's figures for the step a rehearsal runs: first group (no gradients
    during capture), optimizer state taken off. {"peak_bytes_per_rank", "phases"}."""
    r = estimate(model, dataclasses.replace(c, grads_during_capture=False))
    opt = r["optimizer_bytes"]
    phases = {PHASE_OF_PLANNER.get(k, k): v - opt for k, v in r["breakdown"]["phase_peak_bytes"].items()}
    return {"peak_bytes_per_rank": r["peak_bytes_per_rank"] - opt, "phases": phases}


def comparison(model, c: PlanConfig, reh: Rehearsal) -> dict:
    """The JSON "rehearsal" entry: the rehearsal's figures, the planner's for the same
    step, and rehearsal / planner per phase."""
    planned = planned_as_rehearsed(model, c)
    ratio = {"peak_bytes_per_rank": reh.peak_bytes_per_rank / planned["peak_bytes_per_rank"]}
    for name, got in reh.phases.items():
        if planned["phases"].get(name):
            ratio[name] = got / planned["phases"][name]
    return {"peak_bytes_per_rank": reh.peak_bytes_per_rank, "phases": dict(reh.phases), "comm_bytes": {},
            "flops": dict(reh.flops), "host_syncs": reh.host_syncs, "wall_s": reh.wall_s, "device": reh.device,
            "planner": planned, "ratio": ratio,
            "compared": "one step from zero_grad(set_to_none=True), no optimizer state, one rank, CPU branches"}


def format_comparison(entry: dict) -> str:
    """The side-by-side table `longstraw plan --rehearse` prints."""
    gib = 2 ** 30
    planned = entry["planner"]
    rows = [("peak", planned["peak_bytes_per_rank"], entry["peak_bytes_per_rank"])]
    rows += [(k, planned["phases"].get(k), v) for k, v in entry["phases"].items()]
    lines = [f"rehearsal ({entry['compared']}; {entry['wall_s']:.1f} s, {entry['host_syncs']} host syncs)",
             f"  {'phase':<10} {'planner GiB':>12} {'rehearsal GiB':>14} {'rehearsal/planner':>18}"]
    for name, p, r in rows:
        ratio = f"{r / p:18.3f}" if p else f"{'n/a':>18}"
        lines.append(f"  {name:<10} {(p or 0) / gib:12.3f} {r / gib:14.3f} {ratio}")
    return "\n".join(lines)
