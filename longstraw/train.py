"""A small reference GRPO training loop: `longstraw train`, or `train(TrainConfig(...))`
(its configuration: `train_config.py`).

It is a reference loop, not a framework. One iteration:

    item    = task.item("train", step)                       # the data order is the step index
    rollout = engine.generate(item.prompt, num_samples=G, ...)  # one capture, G branches sampled
    rewards = [task.reward(item, r) for r in rollout.responses]
    engine.step(group, grpo, state=rollout.state)            # no second capture
    optimizer.step()

Two arms share everything but the gradient of that update:

    detached  LongStraw, the prompt state is a constant (the LongStraw paper's gradient)
    exact     LongStraw exact mode: gradients also flow back through the prompt

Both sample their rollouts alike, from the same per-step torch.Generator: with one seed
they see the same prompts in the same order. bench/learning/ adds the naive "full" arm
(`train(cfg, update=...)`) and its hybrid preset (a TrainConfig subclass).
`--memory-budget 80GiB` fits the engine's ExecConfig to a memory budget before any work
(`ls.fit_config`, train_budget.py).

Warm start. A tiny random model cannot answer at all, so RL starts from a short
supervised phase at *short* context: cross-entropy on the ideal response (answer + EOS)
of the train split. It learns the format and the lookup at short range, and is poor at
the long P that RL trains at. Its weights are cached on disk by their config, so every
arm of one seed starts from the identical model.

Each step appends one JSON line to `<out_dir>/log.jsonl` (rewards, loss, clip fraction,
KL to the warm start, tokens/s, peak RSS, phase times; held-out accuracy every
`eval_every` steps). A step that changed no weight says why (`no_update`); a run where most
steps do warns once with what to change (`skips.SkipWatch`). Times keep the engine's
meanings: `time_capture_s` is every capture of the step (the one inside `generate`
included), `time_generate_s` the decoding, `time_rollout_s` the rollout phase's wall time.
`<out_dir>/checkpoint.pt` holds the model, the optimizer, the RNG states and the step; a
resumed run continues the same curve (every random draw of a step comes from a generator
seeded by (seed, step)).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from longstraw.checkpoint import append_log, load_checkpoint, truncate_log, write_atomic
from longstraw.engine.engine import Engine
from longstraw.config import GRPOConfig
from longstraw.errors import NonFiniteError
from longstraw.group import BatchTotals, Group
from longstraw.measure import peak_rss_bytes
from longstraw.parallel.context import check_replicas
from longstraw.parallel.launch import inject_signal, phase
from longstraw.parallel.nonfinite import all_finite, inject
from longstraw.skips import TRAIN_ADVICE, SkipWatch, no_update_reason
from longstraw.tasks import KVRecall, ToolLookup
from longstraw.tasks.episodes import TASKS, episode_kwargs, evaluate
from longstraw.train_budget import describe, engine_config
from longstraw.train_config import ARMS, MODEL_PRESETS, TrainConfig, config_from_args
from longstraw.warm import build_model, warm_model, warm_start

# ----------------------------------------------------------------------------
# evaluation


def _save(path: str, model, optimizer, step: int, cfg: TrainConfig, nonfinite: dict) -> None:
    """Write the checkpoint (atomically, `checkpoint.py`); refuse to replace the last good one by weights
    that are not finite."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise NonFiniteError(f"after step {step} the weights are not finite ({len(bad)} tensors, e.g. {bad[0]!r}); "
                             f"{path} keeps the last good checkpoint: lower lr or grad_clip and resume from it")
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg), "nonfinite": dict(nonfinite)}
    write_atomic(path, lambda f: torch.save(ckpt, f))


def _rank() -> int:
    """This process's rank (0 without torch.distributed): rank 0 alone writes the run's files."""
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def _step_generator(cfg: TrainConfig, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + 17)


# ----------------------------------------------------------------------------
# the loop


def engine_update(run: "Run", group: Group, state, grpo: GRPOConfig, totals: BatchTotals) -> dict:
    """The LongStraw arms' update of one group (the form of `train`'s `update=`):
    `engine.step` on the rollout's state, no second capture. Returns {"loss", **metrics}."""
    res = run.engine.step(group, grpo, totals=totals, state=state)
    return {"loss": res.loss, **res.metrics}


@dataclass
class Run:
    """What a run holds between steps (the non-finite guard's counters included)."""

    cfg: TrainConfig
    task: KVRecall | ToolLookup
    model: torch.nn.Module
    engine: Engine
    ref_engine: Engine | None
    optimizer: torch.optim.Optimizer
    grpo: GRPOConfig
    log_path: str
    ckpt_path: str
    start: int
    nonfinite: dict


def train(cfg: TrainConfig, *, update=None, rollouts=None) -> dict:
    """Run (or resume) one GRPO run; returns the final summary dict (the log's last line). Hooks of bench/learning's
    arms: `update(run, group, state, grpo, totals) -> dict` replaces each group's update (default `engine_update`),
    `rollouts(run, step, gen) -> (rollouts, groups)` the sampling (default `_rollouts`)."""
    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, engine_update if update is None else update, rollouts or _rollouts)
    finally:
        torch.set_num_threads(threads)


def _start(cfg: TrainConfig, ckpt: dict | None = None) -> tuple[Run, dict]:
    """Write config.json, build the warm-started model, its frozen reference copy and the
    optimizer, and resume from `ckpt` (the loaded checkpoint.pt) when there is one. Returns (run, warm_info)."""
    mode = "exact" if cfg.arm == "exact" else "detached"
    cp = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1  # under torchrun: one prompt
    exec_cfg = engine_config(cfg, build_model(cfg) if cfg.memory_budget is not None else None, mode=mode,
                             context_parallel=cp)  # over all ranks; DoesNotFitError before any work
    if cfg.memory_budget is not None and _rank() == 0:
        print(f"longstraw train: memory_budget={cfg.memory_budget!r} fits {describe(exec_cfg)}", flush=True)
    os.makedirs(cfg.out_dir, exist_ok=True)
    log_path, ckpt_path = os.path.join(cfg.out_dir, "log.jsonl"), os.path.join(cfg.out_dir, "checkpoint.pt")
    config_json = json.dumps(dataclasses.asdict(cfg), indent=1).encode()
    if _rank() == 0:
        write_atomic(os.path.join(cfg.out_dir, "config.json"), lambda f: f.write(config_json))
    model, warm_info = warm_model(cfg)
    reference = copy.deepcopy(model).requires_grad_(False) if (cfg.log_kl or cfg.beta > 0) else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, nonfinite = 0, {"in_row": 0, "total": 0}  # steps whose gradient norm was NaN/inf
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["torch_rng"])
        start = ckpt["step"]
        nonfinite.update(ckpt.get("nonfinite", {}))
        del ckpt
    if _rank() == 0:
        truncate_log(log_path, start if start > 0 else -1)  # from scratch: the warm-start line is written again
    engine = Engine(model, exec_cfg)
    ref_engine = Engine(reference, dataclasses.replace(exec_cfg, mode="detached")) if reference is not None else None
    grpo = GRPOConfig(loss_type=cfg.loss_type, epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon, beta=cfg.beta,
                      temperature=cfg.temperature)
    run = Run(cfg=cfg, task=cfg.task(), model=model, engine=engine, ref_engine=ref_engine, optimizer=optimizer,
              grpo=grpo, log_path=log_path, ckpt_path=ckpt_path, start=start, nonfinite=nonfinite)
    return run, warm_info


def _rollouts(run: Run, step: int, gen: torch.Generator) -> tuple[list, list]:
    """G samples per prompt of this step from the captured state, and their groups
    (rewards from the task, old log-probs from the sampler)."""
    cfg = run.cfg
    items = [run.task.item("train", step * cfg.prompts_per_step + b) for b in range(cfg.prompts_per_step)]
    rollouts, groups = [], []
    for item in items:
        ro = run.engine.generate(item.prompt, num_samples=cfg.group_size, temperature=cfg.temperature, top_p=1.0,
                                 top_k=0, generator=gen, **episode_kwargs(run.task, item))  # `ro.state` serves the update
        rewards = torch.tensor([run.task.reward(item, r) for r in ro.responses], dtype=torch.float64)
        rollouts.append(ro)
        groups.append(Group(prompt=item.prompt, responses=ro.responses, rewards=rewards, old_logprobs=ro.logprobs,
                            loss_masks=ro.loss_masks))  # observations: context, no loss
    return rollouts, groups


def _reference_kl(run: Run, groups: list, rollouts: list) -> float | None:
    """The reference policy's log-probs: the logged k3 KL to the warm start (None without
    a reference), and the loss's KL term when beta > 0 (set on the groups)."""
    if run.ref_engine is None:
        return None
    cfg, kls = run.cfg, []
    scored = len(groups) if cfg.beta > 0 or cfg.kl_prompts == 0 else min(cfg.kl_prompts, len(groups))
    for grp, ro in zip(groups[:scored], rollouts[:scored]):
        ref = run.ref_engine.score(grp, temperature=cfg.temperature)  # its own capture (other weights)
        if cfg.beta > 0:
            grp.ref_logprobs = ref
        for lp, rlp, mask in zip(ro.logprobs, ref, ro.loss_masks):
            d = (rlp.double() - lp.double())[mask]  # the policy's tokens (not an agent's observations)
            kls.append(torch.exp(d) - d - 1)  # k3 estimator of KL(policy || ref), per token
    return float(torch.cat(kls).mean())


def _optimizer_step(run: Run, params: list) -> tuple[torch.Tensor, bool]:
    """Clip and step, unless the gradient norm is NaN/inf on any rank (under torchrun: agreed
    with one all-reduce, so every rank skips alike): then skip the update (it would reach
    the weights and the next checkpoint) and count it. Returns (grad_norm, finite)."""
    cfg, nonfinite = run.cfg, run.nonfinite
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    finite = all_finite(local=not bool(torch.isfinite(grad_norm)))  # every rank's verdict: one 8-byte all-reduce
    if finite:
        run.optimizer.step()
        nonfinite["in_row"] = 0
    else:
        run.optimizer.zero_grad(set_to_none=True)
        nonfinite["in_row"] += 1
        nonfinite["total"] += 1
    return grad_norm, finite


def _step(run: Run, step: int, update, params: list, rollout_fn) -> dict:
    """One RL step: rollouts, the reference's KL, the update, held-out evaluation; its
    log line is written and returned."""
    cfg = run.cfg
    t_start = time.perf_counter()
    rollouts, groups = rollout_fn(run, step, _step_generator(cfg, step))  # 1. G samples per prompt
    t_gen = time.perf_counter()
    kl = _reference_kl(run, groups, rollouts)  # 2. KL to the warm start (the loss's KL term when beta > 0)
    t_ref = time.perf_counter()
    run.optimizer.zero_grad(set_to_none=True)  # 3. the update
    totals = BatchTotals.of(groups)
    metrics = [update(run, grp, ro.state, run.grpo, totals) for grp, ro in zip(groups, rollouts)]
    calls = sum(ro.metrics["environment_calls"] for ro in rollouts)
    ro_capture = [ro.metrics["time_capture_s"] for ro in rollouts]
    ro_decode = [ro.metrics["time_generate_s"] for ro in rollouts]
    del rollouts  # their prompt states: nothing after the update reads them (not the next capture)
    inject(params, step, _rank())  # test hook (LONGSTRAW_FAULT nan@R:S)
    with phase(f"step {step}: optimizer step"):
        grad_norm, finite = _optimizer_step(run, params)
    if cfg.replica_check_every and (step + 1) % cfg.replica_check_every == 0:
        check_replicas(run.model, run.engine.cp)  # DistributedError if the ranks' weights drifted apart
    t_upd = time.perf_counter()
    ev = {}  # 4. held-out evaluation
    if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
        ev = evaluate(run.engine, run.task, cfg.eval_prompts, split=cfg.eval_split)
    t_eval = time.perf_counter()
    r = torch.cat([g.rewards for g in groups])
    resp_tokens = sum(g.response_tokens for g in groups)
    record = {
        "step": step + 1, "arm": cfg.arm, "model": cfg.model, "prompt_tokens": cfg.prompt_tokens,
        "reward_mean": float(r.mean()), "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "loss": sum(m["loss"] for m in metrics),
        "clip_fraction": sum(m.get("clip_fraction", 0.0) for m in metrics) / len(metrics),
        "skipped_zero_advantage": sum(m.get("skipped_zero_advantage", 0.0) for m in metrics),
        "skipped_no_loss_tokens": sum(m.get("skipped_no_loss_tokens", 0.0) for m in metrics),
        "kl_ref": kl, "grad_norm": float(grad_norm), "response_tokens": resp_tokens,
        "environment_calls": calls,
        "nonfinite_grad": float(not finite), "nonfinite_in_row": run.nonfinite["in_row"],
        "nonfinite_steps": run.nonfinite["total"], "skipped_nonfinite_steps": run.nonfinite["total"],
        "tokens_per_s": (cfg.prompts_per_step * cfg.prompt_tokens + resp_tokens) / (t_upd - t_start),
        "peak_rss_bytes": peak_rss_bytes(),
        "time_ref_s": t_ref - t_gen, "time_update_s": t_upd - t_ref,
        "time_eval_s": t_eval - t_upd, "time_step_s": t_eval - t_start,
        # one meaning per name: capture is capture wherever it ran (inside generate, or again at the update)
        "time_capture_s": sum(ro_capture) + sum(m.get("time_capture_s", 0.0) for m in metrics),
        "time_generate_s": sum(ro_decode), "time_rollout_s": t_gen - t_start,  # decode; the whole rollout phase
        **{k: sum(m.get(k, 0.0) for m in metrics) for k in ("time_replay_s", "time_reverse_s")},
        **ev,
    }
    record["no_update"] = no_update_reason(record, len(groups))  # None: the weights moved
    if _rank() == 0:  # under torchrun every rank holds the same record; one writes it
        append_log(run.log_path, record)
    return record


def _finished(cfg: TrainConfig, ckpt: dict | None) -> dict | None:
    """The last log record of a run in cfg.out_dir whose checkpoint `ckpt` already holds all
    cfg.steps steps (None otherwise): a rerun of it resumes nothing, so it says so."""
    if ckpt is None or ckpt["step"] < cfg.steps:
        return None
    done = ckpt["step"]
    with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    last = next((r for r in reversed(records) if r.get("step") == done), records[-1] if records else {})
    if _rank() == 0:
        print(f"longstraw train: {cfg.out_dir} is finished ({done} of {cfg.steps} steps in its checkpoint); nothing "
              f"to do. To start over: --no-resume (or another --out-dir); to train on: a larger --steps",
              file=sys.stderr, flush=True)
    return last


def _train(cfg: TrainConfig, update, rollout_fn) -> dict:
    ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pt")
    ckpt = load_checkpoint(ckpt_path) if cfg.resume and os.path.exists(ckpt_path) else None  # loaded once
    finished = _finished(cfg, ckpt)
    if finished is not None:
        return finished
    run, warm_info = _start(cfg, ckpt)
    del ckpt  # its tensors now live in the model and the optimizer
    if run.start == 0:
        t0 = time.perf_counter()
        ev = evaluate(run.engine, run.task, cfg.eval_prompts, split=cfg.eval_split)
        if _rank() == 0:
            append_log(run.log_path, {"step": 0, "phase": "warm_start", **warm_info, **ev,
                                      "time_eval_s": time.perf_counter() - t0})
    params = [p for p in run.model.parameters() if p.requires_grad]
    bar = range(run.start, cfg.steps)
    if cfg.progress:
        bar = tqdm(bar, desc=f"train {cfg.arm}", initial=run.start, total=cfg.steps)
    record: dict = {}
    watch = SkipWatch("longstraw train", TRAIN_ADVICE, total=cfg.steps - run.start)  # warns once if most skip
    for step in bar:
        inject_signal(step, _rank())  # test hook (LONGSTRAW_FAULT kill@R:S / stop@R:S)
        record = _step(run, step, update, params, rollout_fn)
        if cfg.progress:
            ev = [v for k, v in record.items() if k.endswith("_accuracy")]
            shown = [f"reward={record['reward_mean']:.2f}"] + ([f"acc={ev[0]:.2f}"] if ev else [])
            bar.set_postfix_str(", ".join(shown + ([record["no_update"]] if record["no_update"] else [])))
        if _rank() == 0:  # every rank holds the same record; one says it
            watch.step(record["no_update"], reward_mean=record["reward_mean"])
        in_row = run.nonfinite["in_row"]
        if in_row >= cfg.max_nonfinite_steps:
            raise NonFiniteError(
                f"the gradient norm was not finite ({record['grad_norm']}) for {in_row} steps in a row "
                f"(steps {step + 2 - in_row}..{step + 1}); their updates were skipped and {run.ckpt_path} "
                "holds the last good weights. Lower lr, check the rewards and the model dtype, or raise "
                "max_nonfinite_steps"
            )
        if ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps) and _rank() == 0:
            _save(run.ckpt_path, run.model, run.optimizer, step + 1, cfg, run.nonfinite)  # the replicas': rank 0's
    if _rank() == 0:
        watch.finish()
    return record


__all__ = ["TrainConfig", "train", "warm_model", "load_checkpoint", "write_atomic", "warm_start", "build_model",
           "evaluate", "engine_update", "config_from_args", "episode_kwargs", "MODEL_PRESETS", "ARMS", "TASKS"]
