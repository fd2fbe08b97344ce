"""`longstraw plan ... --rehearse`: the planner's figures beside a rehearsal's, phase by phase.

The planner (`longstraw.plan.estimate`) estimates a step's peak per rank analytically; a
rehearsal (`ls.rehearse`) runs the engine's own step on fake tensors at the same size and
counts its live tensors. This module turns a `PlanConfig` into the rehearsal of the same
step and sets the two side by side.

What is compared: a rehearsal runs one step from `zero_grad(set_to_none=True)` with no
optimizer state, so the planner is asked for the same step (`grads_during_capture=False`)
and its optimizer state is taken off every figure (peak and phases). The planner's
"recompute" phase is the rehearsal's "walk" (exact mode's reverse walk).

Under `--gpus W > 1` the step is context parallel (`ExecConfig(context_parallel=True)`)
and ranks 0 and W - 1 are rehearsed on the fake process group (`rehearsal/ranks.py`):
rank 0 holds the most prompt rows (the planner's per-rank peak is the fullest rank's);
rank W - 1 the fewest, so it receives the most of capture's traffic and, unlike rank 0
(the source), the gradients' broadcast; under `--expert-parallel` also the first rank
holding the most experts (`ranks.rehearsed_ranks`). The peak compared is the highest
rank's; the bytes received per phase the most any rank received (the planner's: the
busiest rank's). `--shard-params` shards the fake model with FSDP2 over the W ranks as a
real run's template does (`parallel.sharding.shard_model`; the experts too, unless
expert parallelism holds them), `--expert-parallel` gives each rank its slice of the experts
(`ExecConfig(expert_parallel=True)`).

Host memory is compared apart: the rehearsal's `host_bytes` (`longstraw.host.host_tensor`:
state offload's arenas, exact mode's offloaded snapshots) beside the planner's host
figure; the peaks are the device's alone, on the CPU branches too.

Rehearsed so far: full training or LoRA (`--lora-rank`, the planner's adapters:
`rehearsal/lora.py`) over weights in the compute dtype (no quantised weights), a tree of
at most one shared segment (`--tree Sx1,LxG`, or `LxG`), no images, the state on the
device or offloaded (`--offload-state`, `--offload-snapshots`), the weights replicated or
sharded (`--shard-params`, `--expert-parallel`). Anything else is refused with
`ConfigError` before a fake model is built.
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
from longstraw.rehearsal.ranks import rehearsed_ranks
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


def shared_prefix(c: PlanConfig) -> int:
    """The responses' shared first tokens of `c`'s tree (0 without one): a tree of one
    shared segment and G leaves (`Sx1,LxG`) is rehearsable, a flat `LxG` too."""
    if c.tree is None or len(c.tree) == 1:
        return 0
    return c.tree[0][0]


def refuse_unrehearsed(c: PlanConfig) -> None:
    """`ConfigError` for a planned configuration a rehearsal cannot run yet (before any work)."""
    deep_tree = c.tree is not None and (len(c.tree) > 2 or (len(c.tree) == 2 and c.tree[0][1] != 1))
    quant = c.weight_dtype not in (None, c.dtype)
    unsupported = {f"--weight-dtype {c.weight_dtype} (quantized weights are bitsandbytes' / torchao's packed "
                   "tensors: they are quantized from real data on load, and their matmuls are CUDA kernels with no "
                   "fake-tensor implementation, so a fake model cannot hold them; bitsandbytes is not installed "
                   "here either; rehearse the same adapters over bf16 weights: only the frozen weights' "
                   "bytes differ, and the planner states those)": quant,
                   "--tree beyond one shared segment (Sx1,LxG: a rehearsal draws one shared prefix)": deep_tree,
                   "--images": bool(c.images),
                   "--score-passes": bool(c.score_passes),
                   "--data-parallel > 1": c.data_parallel > 1, "--generate": c.generate}
    bad = [flag for flag, on in unsupported.items() if on]
    if bad:
        raise ConfigError(f"longstraw plan --rehearse: not rehearsed yet: {', '.join(bad)}; drop them to rehearse "
                          "the rest (docs/rehearse.md)")


def rehearsal_exec_config(c: PlanConfig, allow_position_overflow: bool = False) -> ExecConfig:
    """The `ExecConfig` of planned configuration `c` (context parallel for `--gpus > 1`,
    expert parallel for `--expert-parallel`), as `--fit` prints it for a real run;
    `allow_position_overflow`: P + R may pass the model's `max_position_embeddings`."""
    fields = dict(exec_config(c))
    fields["allow_position_overflow"] = allow_position_overflow
    if fields.get("recompute_layers") is None:
        fields.pop("recompute_layers")
    if fields.get("offload_snapshots") is None:
        fields.pop("offload_snapshots")
    return ExecConfig(**fields)


def rehearsed_plan_ranks(c: PlanConfig, hf=None) -> list[int] | None:
    """The ranks `rehearse_plan` rehearses: 0 (the most prompt rows), W - 1 (the most
    capture traffic, a receiver of the gradients' broadcast) and, under expert
    parallelism, the first rank holding the most experts (of HF config `hf`); None for
    one rank."""
    if c.gpus == 1:
        return None
    most = rehearsed_ranks(hf, rehearsal_exec_config(c), c.gpus, None) if hf is not None else []
    return sorted({0, c.gpus - 1, *most})


def rehearse_plan(model, c: PlanConfig, *, steps: int = 1, allow_position_overflow: bool = False,
                  progress: bool = False, workers: int = 1) -> Rehearsal:
    """Rehearse `steps` of the step planned by (`model`, `c`) on the CPU branches: one rank,
    or the ranks of `rehearsed_plan_ranks` of `c.gpus` on the fake process group, with FSDP2
    (`c.shard_params`) and expert parallelism (`c.expert_parallel`) as a real run.
    `progress`: a stderr line as each phase ends; `workers`: ranks rehearsed at once, each in
    a process of its own (`rehearse`)."""
    refuse_unrehearsed(c)
    dtype = DTYPES.get(str(c.dtype or "bf16").lower())
    if dtype is None:
        raise ConfigError(f"longstraw plan --rehearse: dtype {c.dtype!r} is not one of {', '.join(DTYPES)}")
    hf = hf_config(model)
    return rehearse(hf, rehearsal_exec_config(c, allow_position_overflow), prompt_tokens=c.prompt_tokens,
                    group=c.group, response_tokens=c.response_tokens, device="cpu", dtype=dtype, steps=steps,
                    world_size=c.gpus, rank=rehearsed_plan_ranks(c, hf), shard_params=c.shard_params,
                    shared_prefix=shared_prefix(c), lora_rank=c.lora_rank, lora_targets=c.lora_targets,
                    progress=progress, workers=workers)


def planned_as_rehearsed(model, c: PlanConfig) -> dict:
    """The planner's figures for the step a rehearsal runs: first group (no gradients
    during capture), optimizer state taken off. {"peak_bytes_per_rank", "phases",
    "comm_bytes": {phase: bytes the busiest rank receives}, "host_bytes": state offload's
    host arenas and exact mode's offloaded snapshots}."""
    r = estimate(model, dataclasses.replace(c, grads_during_capture=False))
    opt = r["optimizer_bytes"]
    phases = {PHASE_OF_PLANNER.get(k, k): v - opt for k, v in r["breakdown"]["phase_peak_bytes"].items()}
    comm = {k: sum(v["bytes"].values()) for k, v in r["comm"]["phases"].items() if "bytes" in v}
    host = r["offload_host_bytes_per_rank"] + (r["exact_snapshots"] or {}).get("host_bytes", 0)
    return {"peak_bytes_per_rank": r["peak_bytes_per_rank"] - opt, "phases": phases,
            "comm_bytes": {k: v for k, v in comm.items() if v}, "host_bytes": host}


def received(reh: Rehearsal) -> dict[str, int]:
    """{phase: bytes}: the most any rehearsed rank received in the phase, all collectives together."""
    out: dict[str, int] = {}
    for comm in (reh.rank_comm_bytes or {reh.rank: reh.comm_bytes}).values():
        for phase, by in comm.items():
            out[phase] = max(out.get(phase, 0), sum(by.values()))
    return out


def comparison(model, c: PlanConfig, reh: Rehearsal) -> dict:
    """The JSON "rehearsal" entry: the rehearsal's figures, the planner's for the same
    step, and rehearsal / planner per phase (peaks; "comm_<phase>": bytes received)."""
    planned = planned_as_rehearsed(model, c)
    ratio = {"peak_bytes_per_rank": reh.peak_bytes_per_rank / planned["peak_bytes_per_rank"]}
    # detached mode's "walk" opens and runs nothing (its peak is what the step holds on entry): not shown
    phases = {k: v for k, v in reh.phases.items() if k != "walk" or c.mode == "exact"}
    for name, got in phases.items():
        if planned["phases"].get(name):
            ratio[name] = got / planned["phases"][name]
    if planned["host_bytes"]:
        ratio["host_bytes"] = reh.host_bytes / planned["host_bytes"]
    got_comm = received(reh)
    for name, got in got_comm.items():
        if planned["comm_bytes"].get(name):
            ratio[f"comm_{name}"] = got / planned["comm_bytes"][name]
    steps = "one step" if len(reh.steps) <= 1 else f"{len(reh.steps)} steps, each"
    ranks = "one rank" if c.gpus == 1 else f"ranks {', '.join(map(str, sorted(reh.rank_peaks)))} of {c.gpus}"
    return {"peak_bytes_per_rank": reh.peak_bytes_per_rank, "phases": phases,
            "step_peaks": [s.peak_bytes for s in reh.steps], "ops": [s.ops for s in reh.steps],
            "comm_bytes": {k: dict(v) for k, v in reh.comm_bytes.items()}, "comm_received": got_comm,
            "host_bytes": reh.host_bytes, "host_phases": dict(reh.host_phases),
            "rank": reh.rank, "rank_peaks": dict(reh.rank_peaks), "world_size": reh.world_size,
            "flops": dict(reh.flops), "host_syncs": reh.host_syncs, "wall_s": reh.wall_s, "device": reh.device,
            "planner": planned, "ratio": ratio,
            "compared": f"{steps} from zero_grad(set_to_none=True), no optimizer state, {ranks}, CPU branches"}


def format_comparison(entry: dict) -> str:
    """The side-by-side table `longstraw plan --rehearse` prints (peaks in GiB; under
    `--gpus > 1` also the bytes received per phase, in MiB)."""
    gib, mib = 2 ** 30, 2 ** 20
    planned = entry["planner"]
    rows = [("peak", planned["peak_bytes_per_rank"], entry["peak_bytes_per_rank"], gib)]
    rows += [(k, planned["phases"].get(k), v, gib) for k, v in entry["phases"].items()]
    rows += [(k, v, None, gib) for k, v in planned["phases"].items() if k not in entry["phases"]]
    if planned.get("host_bytes") or entry.get("host_bytes"):
        rows.append(("host", planned.get("host_bytes"), entry.get("host_bytes"), gib))
    comm = entry.get("comm_received", {})
    rows += [(f"{k} recv", planned["comm_bytes"].get(k), comm.get(k), mib)
             for k in list(comm) + [k for k in planned["comm_bytes"] if k not in comm]]
    steps = entry.get("step_peaks", [])
    lines = [f"rehearsal ({entry['compared']}; {entry['wall_s']:.1f} s, {entry['host_syncs']} host syncs"
             + (f"; step peaks {', '.join(f'{b / gib:.3f}' for b in steps)} GiB" if len(steps) > 1 else "")
             + (f"; peak on rank {entry['rank']}" if entry.get("world_size", 1) > 1 else "") + ")",
             f"  {'phase':<15} {'planner':>12} {'rehearsal':>14} {'rehearsal/planner':>18}"]
    for name, p, r, unit in rows:
        ratio = f"{r / p:18.3f}" if p and r is not None else f"{'n/a':>18}"
        got = f"{r / unit:14.3f}" if r is not None else f"{'n/a':>14}"
        lines.append(f"  {name:<15} {(p or 0) / unit:8.3f} {'GiB' if unit == gib else 'MiB'} {got} {ratio}")
    return "\n".join(lines)
