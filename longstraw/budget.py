"""The engine keeps a memory budget: `ls.fit_config(model, memory_budget=..., ...)` runs the
planner's search (`plan/fit.py`) for this model's real shapes and dtype and returns the
fastest `ExecConfig` whose step fits, or raises `DoesNotFitError` before any work.

    cfg = ls.fit_config(model, memory_budget="20GiB", prompt_tokens=1_048_576, group=8,
                        response_tokens=4096, mode="detached")
    engine = ls.Engine(model, cfg)

What the budget counts: what the step adds above the loaded model and its gradients (the
prompt state, its gradients in exact mode, the largest phase's working set, kept graphs).
The planner's peak also holds the weights, gradients and optimizer state; `fit_config`
plans against `memory_budget + those` so that they cancel. The optimizer is the caller's.

A model already wrapped with FSDP2 (`parallel.sharding.shard_model`: its layers' parameters
are sharded DTensors) is planned as `longstraw plan --shard-params` at the W of their mesh:
its weights, gradients and optimizer state per rank are the sharded ones (outside the
budget), and the two decoder layers FSDP2 holds gathered at a time are inside it.

The model's shapes reach the planner through one seam, `longstraw/shapes.py` (its HF config
as the planner's dict); plan/ stays torch-free.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from longstraw import fit_advice
from longstraw.config import ExecConfig
from longstraw.errors import ConfigError, DoesNotFitError
from longstraw.ops import kernels
from longstraw.ops.flash import fused_backward_kernel
from longstraw.parallel.fsdp import shard_world
from longstraw.plan.arch import parse_bytes
from longstraw.plan.config import PlanConfig
from longstraw.plan.estimate import estimate
from longstraw.plan.fit import exec_config, exec_config_text, search
from longstraw.shapes import planner_config

__all__ = ["fit_config", "parse_budget", "AUTO_RESERVE", "RUNTIME_RESERVE_BYTES", "RUNTIME_RESERVE_SHARE"]

AUTO_RESERVE = 2 * 2**30
"""memory_budget="auto" on CUDA: free memory minus this (allocator fragmentation, the
CUDA context's growth, cuBLAS workspaces)."""

RUNTIME_RESERVE_BYTES = 16 * 2**20
RUNTIME_RESERVE_SHARE = 0.05
"""Of every budget, max(16 MiB, 5%) is held back from the planner's peak: what a step holds
beyond its live tensors (allocator slack, the autograd engine's and BLAS's workspaces).
Measured on CPU (bench/bench_fit_config.py, tiny qwen3, a fresh process): RSS above the
model and its gradients was 10-16 MiB above the planner's figure at P = 8,192."""

# ExecConfig fields the search sets, and the PlanConfig field each is
_SEARCHABLE = {"mode": "mode", "chunk_size": "chunk_size", "branch_chunk_size": "branch_chunk_size",
               "recompute_layers": "recompute_layers", "offload_snapshots": "offload_snapshots",
               "expert_parallel": "expert_parallel", "keep_graph_bytes": "keep_graph_bytes",
               "keep_attention_outputs": "keep_attention_outputs", "share_response_prefixes": "share_response_prefixes",
               "replay_batch": "replay_batch"}
_PLAN_ONLY = {"attention_block_size", "logits_chunk_size", "divide_capture", "divide_walk", "shard_block_size"}


def parse_budget(memory_budget, device: torch.device) -> int:
    """Bytes of `memory_budget`: an int, a size string ("80GiB", "20GB"), or "auto" on
    CUDA (free memory minus `AUTO_RESERVE`)."""
    if isinstance(memory_budget, str) and memory_budget.strip().lower() == "auto":
        if device.type != "cuda":
            raise ConfigError(f"memory_budget='auto' reads the free CUDA memory, but the model is on {device}; "
                              "give bytes or a size such as '20GiB'")
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free - AUTO_RESERVE)
    if isinstance(memory_budget, bool):
        raise ConfigError(f"memory_budget must be bytes or a size such as '80GiB', got {memory_budget!r}")
    try:
        value = parse_bytes(memory_budget)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"memory_budget must be bytes or a size such as '80GiB', got {memory_budget!r}") from exc
    if value <= 0:
        raise ConfigError(f"memory_budget must be > 0, got {memory_budget!r}")
    return value


def _device_and_dtype(model) -> tuple[torch.device, str]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, str(p.dtype).removeprefix("torch.")
    return torch.device("cpu"), "float32"


def _lora(model) -> tuple[int | None, str]:
    """(rank, targets) of a PEFT LoRA model, else (None, "attention")."""
    cfg = getattr(model, "peft_config", None)
    if not cfg:
        return None, "attention"
    first = next(iter(cfg.values()))
    targets = {str(t) for t in (getattr(first, "target_modules", None) or [])}
    return getattr(first, "r", None), ("all-linear" if targets & {"gate_proj", "up_proj", "down_proj"} else "attention")


def fit_config(model, *, memory_budget, prompt_tokens: int, group: int | None = None,
               response_tokens: int | None = None, mode: str = "detached", held_states: int = 0,
               generate: bool = False, images: int = 0, image_tokens: int = 0, prompt_inputs: dict | None = None,
               tree=None, process_group=None, **fixed) -> ExecConfig:
    """The fastest `ExecConfig` whose step fits `memory_budget` above the loaded model.

    Args:
        model: the HF `...ForCausalLM` the engine will run (PEFT-wrapped too; FSDP2-wrapped:
            planned as `shard_params` at its mesh's W, the two gathered layers in the budget).
        memory_budget: bytes the step may add above the model and its gradients: an int,
            "80GiB" / "20GB", or on CUDA "auto" (free memory minus `AUTO_RESERVE`). The
            planner's peak must fit it less max(16 MiB, 5%) (`RUNTIME_RESERVE_*`).
        prompt_tokens: P, the prompt length of the step to fit.
        group: G, the responses per prompt (with `tree`: its leaves, or omitted).
        response_tokens: R, the tokens per response (with `tree`: its segments' sum, or omitted).
        mode: "detached" or "exact" (kept as given).
        held_states: other prompt states of this P alive during the step (a trainer that
            keeps a generation batch's states until their updates): each adds the
            planner's state bytes per rank, and in exact mode its recurrent snapshots on
            the device, to what the budget holds (`held_state_bytes`). Default 0.
        generate: the responses are sampled by `Engine.generate` (G branches decoding
            together from the prompt state, `plan/generate.py`): its phase must fit too.
            `longstraw train` and the TRL trainer pass True. Default False (a step of
            given responses).
        images / image_tokens: a VLM's prompt images (Qwen3.5 / 3.6): N images of at most T
            merged tokens each (HF's t * h * w / merge^2). Their rows, exact mode's row
            gradient and one image's tower pass are planned (`plan/vision.py`); the
            tower's weights, gradients and Adam state are the model's (outside the budget).
        prompt_inputs: instead of images / image_tokens, the prompt's inputs as
            `Group.prompt_inputs` (their `image_grid_thw` gives N and the largest T).
        tree: the responses share prefixes (tree rollouts, agent episodes forked after some
            turns; docs/trees.md): their prefix tree as levels below the prompt,
            [(segment_tokens, fan_out), ...] or "1024x2,256x4" (`PlanConfig.tree`,
            docs/planner.md "Prefix trees"). The engine's tree path is planned (the
            segments' states held while their children replay, each segment's walk
            chunks), and `share_response_prefixes` is searched (tree or flat) unless
            pinned. None: G responses of R tokens that share nothing.
        process_group: with `context_parallel=True`, the ranks that share the prompt (as
            `Engine(process_group=)`); None: the default group.
        **fixed: ExecConfig fields to pin (e.g. `branch_chunk_size=2048`,
            `recompute_layers=False`, `context_parallel=True`); the others are searched.

    Returns:
        ExecConfig.

    Raises:
        DoesNotFitError: nothing fits; the message names the binding term and the
            changes that would fit. Raised before any work: the model is not run.
        ConfigError: a bad budget, `held_states` < 0, a non-bool `generate`, bad image
            arguments, an unknown field in `fixed`, or FSDP2 not over the context-parallel ranks.
    """
    _check_arguments(held_states, generate, fixed)
    group, response_tokens = _group_shape(group, response_tokens, tree)
    images, image_tokens = _images(model, images, image_tokens, prompt_inputs)
    device, dtype = _device_and_dtype(model)
    budget = parse_budget(memory_budget, device)
    cp = bool(fixed.get("context_parallel", False))
    world = torch.distributed.get_world_size(process_group) if cp and torch.distributed.is_initialized() else 1
    rank, targets = _lora(model)
    plan_fixed = {_SEARCHABLE.get(k, k): v for k, v in fixed.items() if k in _SEARCHABLE or k in _PLAN_ONLY}
    offload = fixed.get("state_device") is not None and torch.device(fixed["state_device"]).type == "cpu"
    pinned = _pinned(plan_fixed, fixed, device, dtype, world)
    fused = fused_backward_kernel(device.type, getattr(torch, dtype)) is not None
    plan_fixed.setdefault("keep_attention_outputs", False)  # the search starts without them and offers them
    base = PlanConfig(prompt_tokens=prompt_tokens, group=group, response_tokens=response_tokens, mode=mode,
                      gpus=world, dtype=dtype, lora_rank=rank, lora_targets=targets, offload_state=offload,
                      gdn_kernel=gdn_kernel(device, dtype), fused_backward=fused, reserve=0, generate=generate,
                      images=images, image_tokens=image_tokens, tree=tree,
                      shard_params=_fsdp2_ranks(model, cp, world), **plan_fixed)
    cfg = planner_config(model)
    held = estimate(cfg, base)
    outside = _model_bytes(held)
    reserve = _reserve(budget)
    result, others = _search_beside_held(cfg, base, pinned, budget, outside, held_states, held)
    if not hasattr(result, "config"):
        _raise_does_not_fit(cfg, base, pinned, fixed, result, memory_budget, budget, outside - others,
                            _step_text(base, held_states, others), reserve)
    chosen = {k: v for k, v in exec_config(result.config).items() if k != "context_parallel"}  # with any offload
    returned = ExecConfig(**{**chosen, **fixed})
    return _check_returned(cfg, base, returned, budget + outside - others - reserve, reserve)


def _raise_does_not_fit(cfg, base, pinned, fixed, result, memory_budget, budget: int, outside: int, step: str,
                        reserve: int):
    """Raise `DoesNotFitError` for a search that found nothing: the binding term, the least
    budget that fits and the changes that would (`outside`: the model's bytes less the
    other held states')."""
    what = _does_not_fit(result, memory_budget, budget, outside, step, reserve)
    smallest = _smallest_budget(cfg, base, pinned, result.leanest["peak_bytes_per_rank"] - outside, outside)
    changes = _changes(cfg, base, pinned, set(fixed) & set(_SEARCHABLE), result, budget, outside)
    raise DoesNotFitError(fit_advice.message(what, smallest, changes, "python"), what=what,
                          smallest_budget=smallest, changes=changes)


def _check_returned(cfg, base, returned: ExecConfig, ceiling: int, reserve: int) -> ExecConfig:
    """`returned`, after checking that what is returned is what was planned: its peak is at
    most the `ceiling` the search fitted."""
    again = estimate(cfg, replace(base, **_plan_fields(returned), reserve=reserve))
    if again["peak_bytes_per_rank"] > ceiling:
        raise AssertionError(f"fit_config: the returned {returned} plans {int(again['peak_bytes_per_rank']):,} B, "
                             f"above the {int(ceiling):,} B its search fitted")
    return returned


def _fsdp2_ranks(model, cp: bool, world: int) -> bool:
    """Whether `model` is FSDP2-wrapped (planned as `shard_params`, pinned: `_pinned`), after
    checking that it shards over the `world` context-parallel ranks the plan divides the
    prompt over (the planner's one W)."""
    ranks = shard_world(model)
    if ranks is None:
        return False
    if not cp or ranks != world:
        where = f"context_parallel over {world} rank(s)" if cp else "context_parallel off"
        raise ConfigError(f"fit_config: the model is FSDP2-wrapped over {ranks} ranks, but {where}; the planner "
                          "shards weights over the ranks that share the prompt (parallel.sharding.shard_model over "
                          f"the context-parallel group): pass context_parallel=True with a process_group of {ranks} "
                          "ranks")
    return True


def _pinned(plan_fixed: dict, fixed: dict, device: torch.device, dtype: str, world: int) -> set:
    """The planner fields the search keeps: the caller's, the mode, and what the engine
    here cannot use."""
    pinned = set(plan_fixed) | {"mode", "shard_params"}  # FSDP2 is the caller's wrapping, not an ExecConfig field
    if device.type == "cpu" or "state_device" in fixed:  # on CPU, host offload saves nothing
        pinned |= {"offload_state"}
    if world < 2:
        pinned |= {"expert_parallel"}
    if fused_backward_kernel(device.type, getattr(torch, dtype)) is None:  # kept attention outputs: measured
        pinned |= {"keep_attention_outputs"}                             # on CPU's fused kernel only so far
    return pinned


def _check_arguments(held_states, generate, fixed: dict) -> None:
    """`ConfigError` for `fit_config`'s bad `held_states`, `generate` or unknown fields."""
    if not isinstance(held_states, int) or held_states < 0:
        raise ConfigError(f"fit_config: held_states must be an int >= 0, got {held_states!r}")
    if not isinstance(generate, bool):
        raise ConfigError(f"fit_config: generate must be True or False, got {generate!r}")
    unknown = set(fixed) - set(ExecConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"fit_config: unknown ExecConfig field(s) {sorted(unknown)}")


def _group_shape(group, response_tokens, tree) -> tuple[int, int]:
    """(G, R) of `fit_config`'s group: as given, or a tree's leaves and segments' sum
    (`ConfigError` when given ones disagree with the tree, or neither is given)."""
    if tree is None:
        if group is None or response_tokens is None:
            raise ConfigError("fit_config: give group and response_tokens (or tree=, e.g. [(2048, 1), (256, 8)])")
        return group, response_tokens
    t = PlanConfig(prompt_tokens=1, tree=tree)  # parses and checks it
    for name, given, own in (("group", group, t.group), ("response_tokens", response_tokens, t.response_tokens)):
        if given is not None and given != own:
            raise ConfigError(f"fit_config: {name}={given!r} disagrees with tree={tree!r}, which has {own} "
                              f"({'leaves' if name == 'group' else 'tokens per response'}); omit {name} or fix it")
    return t.group, t.response_tokens


def _model_bytes(plan: dict) -> float:
    """What the planner's peak holds that the budget does not: the model's weights, their
    gradients and the optimizer state, a VLM tower's included (its vision static less the
    image rows, which the step adds)."""
    return (plan["param_bytes"] + plan["grad_bytes"] + plan["optimizer_bytes"] + plan["vision_static_bytes"]
            - plan["vision_rows_bytes"])


def _step_text(base: PlanConfig, held_states: int, others: float) -> str:
    """The step `DoesNotFitError` names: P, G, R, the mode, a rollout, images, held states."""
    step = f"P={base.prompt_tokens:,}, G={base.group}, R={base.response_tokens:,}, mode={base.mode!r}"
    step += ", generated" if base.generate else ""
    if base.tree is not None:
        step += ", tree " + ",".join(f"{n}x{f}" for n, f in base.tree)
    if base.images:
        step += f", {base.images} image(s) of <= {base.image_tokens:,} tokens"
    if held_states:
        step += f", {held_states} other prompt state(s) held ({int(others):,} B)"
    return step


def _images(model, images: int, image_tokens: int, prompt_inputs: dict | None) -> tuple[int, int]:
    """(N images, the largest one's merged tokens) of `fit_config`'s image arguments:
    given, or from `prompt_inputs["image_grid_thw"]` ([N, 3] of (t, h, w) patches) and the
    model's `vision_config.spatial_merge_size`."""
    for name, value in (("images", images), ("image_tokens", image_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"fit_config: {name} must be an int >= 0, got {value!r}")
    if prompt_inputs is None or prompt_inputs.get("image_grid_thw") is None:
        if prompt_inputs is not None and prompt_inputs.get("pixel_values") is not None:
            raise ConfigError("fit_config: prompt_inputs has pixel_values but no image_grid_thw (HF's processor "
                              "returns both)")
        return images, image_tokens
    if images or image_tokens:
        raise ConfigError("fit_config: give prompt_inputs or images / image_tokens, not both")
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None:
        raise ConfigError(f"fit_config: prompt_inputs has images, but {type(model).__name__} has no vision_config "
                          "(images run on Qwen3.5 / 3.6 ...ForConditionalGeneration models)")
    grid = torch.as_tensor(prompt_inputs["image_grid_thw"]).reshape(-1, 3)
    tokens = (grid.prod(-1) // int(vision.spatial_merge_size) ** 2).tolist()
    return len(tokens), int(max(tokens, default=0))


def _search_beside_held(cfg, base: PlanConfig, pinned: set, budget: int, outside: float, held_states: int,
                        held: dict):
    """The search at `budget` beside `held_states` other prompt states (each `held_state_bytes`,
    inside the budget, outside the step's plan). A held state's exact snapshots depend on the
    chunk the search picks, so it searches again (at most 4 times) until the held bytes settle.
    Returns (the search's result, the held bytes it was searched beside)."""
    others = held_states * held_state_bytes(held)
    for _ in range(4):
        result = search(cfg, _at(base, budget, outside - others), pinned)
        if not (held_states and hasattr(result, "config")):
            break
        chosen_others = held_states * held_state_bytes(estimate(cfg, replace(result.config, reserve=_reserve(budget))))
        if chosen_others <= others:
            break
        others = chosen_others
    return result, others


def _reserve(budget: int) -> int:
    """The runtime reserve the planner's peak must leave free of `budget`: max(16 MiB, 5%)."""
    return max(RUNTIME_RESERVE_BYTES, int(RUNTIME_RESERVE_SHARE * budget))


def _at(base: PlanConfig, budget: int, outside: float) -> PlanConfig:
    """`base` planned against `budget` above the model: the planner's memory holds `outside`
    (the model, its gradients and optimizer, less other held states) and the runtime reserve."""
    return replace(base, gpu_memory=int(budget + outside), reserve=_reserve(budget))


def _smallest_budget(cfg, base: PlanConfig, pinned: set, need: float, outside: float) -> int:
    """The least budget (bytes above the model) whose search fits: the leanest plan adds
    `need`, and `_at` plans `budget + outside` less a reserve of max(16 MiB, 5%) of it.
    Found on that arithmetic (the search's own test of its leanest plans), then checked by
    one search."""
    peak = need + outside

    def fits(b: int) -> bool:
        at = _at(base, b, outside)
        return peak <= at.gpu_memory - at.reserve

    b = max(math.ceil(need) + RUNTIME_RESERVE_BYTES, math.ceil(need / (1 - RUNTIME_RESERVE_SHARE)))
    while not fits(b):
        b += 1
    while b > 1 and fits(b - 1):
        b -= 1
    if not hasattr(search(cfg, _at(base, b, outside), pinned), "config"):
        raise AssertionError(f"fit_config: no fit at {b:,} B, where the leanest plan adds {int(need):,} B")
    return b


def _changes(cfg, base: PlanConfig, pinned: set, given: set, result, budget: int, outside: float) -> list:
    """The changes that fit at this budget, in fit_config's terms (`DoesNotFitError.changes`):
    the planner's smaller P and more ranks, and each field the caller pinned (`given`, and
    an exact `mode`) that, set free, fits."""
    out = []
    for change in result.changes:
        if "prompt_tokens" in change:
            out.append({"prompt_tokens": change["prompt_tokens"]})
        elif "gpus" in change:
            out.append({"ranks": change["gpus"], "fsdp2": bool(change.get("shard_params")),
                        "expert_parallel": bool(change.get("expert_parallel"))})
    for name in sorted(given - {"mode"}) + (["mode"] if base.mode == "exact" else []):
        freed = search(cfg, _at(replace(base, mode="detached") if name == "mode" else base, budget, outside),
                       pinned - {name})
        if hasattr(freed, "config"):
            out.append({"unpin": name, "pinned": getattr(base, name), "value": getattr(freed.config, name)})
    return out


def held_state_bytes(plan: dict) -> float:
    """What one more prompt state of the step holds on the rank while it waits for its
    update (`held_states`): its device part and, in exact mode, its recurrent snapshots on
    the device (`exact_checkpoint_bytes_per_rank`, 0 detached or offloaded)."""
    return plan["state_bytes_on_gpu_per_rank"] + plan["exact_checkpoint_bytes_per_rank"]


def gdn_kernel(device: torch.device, dtype: str) -> str:
    """The GDN kernel the engine will run (`ops.kernels.pick`): flash-linear-attention's
    ('fla') only on CUDA in bf16 / fp16 (`kernels.suits`) with fla importable, else the torch kernel."""
    if not kernels.suits(device.type, getattr(torch, dtype)):
        return "torch"
    return "fla" if kernels.load("chunk_gated_delta_rule") is not None else "torch"


def _plan_fields(cfg: ExecConfig) -> dict:
    """The PlanConfig fields an ExecConfig sets (the search's and the plan-only ones)."""
    out = {plan: getattr(cfg, name) for name, plan in _SEARCHABLE.items()}
    out.update({name: getattr(cfg, name) for name in _PLAN_ONLY})
    out["offload_state"] = cfg.state_device is not None and torch.device(cfg.state_device).type == "cpu"
    return out


def _does_not_fit(result, memory_budget, budget: int, outside: float, step: str, reserve: int) -> str:
    """What does not fit: what the leanest plan (as an ExecConfig) adds above the model and
    its largest term (`DoesNotFitError.what`; the changes follow it, `fit_advice.message`)."""
    r = result.leanest
    phase = r["peak_phase"]
    terms = {"prompt state": r["state_bytes_on_gpu_per_rank"], "state gradients": r["state_grad_bytes_per_rank"],
             "recurrent snapshots": r["exact_checkpoint_bytes_per_rank"], "gathered weights": r["gathered_param_bytes"],
             f"{phase} working set": r["peak_bytes_per_rank"] - r["static_bytes_per_rank"]}
    largest = max(terms, key=terms.get)
    adds = r["peak_bytes_per_rank"] - outside
    lean = exec_config_text(result.leanest_config).split("  +")[0]  # FSDP2 is never searched here
    return (f"no ExecConfig fits memory_budget={memory_budget!r} ({budget:,} B above the model, less a runtime "
            f"reserve of {reserve:,} B) for {step}: even the leanest setting, {lean}, adds {int(adds):,} B "
            f"(peak during {phase}); binding term: {largest} {int(terms[largest]):,} B")
