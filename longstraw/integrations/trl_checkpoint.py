"""Checkpoints of `LongStrawGRPOTrainer` through TRL's own save and resume
(`save_strategy="steps"`, `trainer.train(resume_from_checkpoint=...)`), on one process or
many. The model and optimizer state go through torch.distributed.checkpoint (DCP): every
rank writes and reads its own part, keyed by parameter name (`get_state_dict` /
`set_state_dict`, which handle FSDP2's DTensors too), so a checkpoint written at one W
loads at any other (DCP reshards; a replicated tensor is written once).

A `checkpoint-N` folder (the Trainer's names where it has them):

    longstraw_dcp/         model + optimizer state (DCP; read on resume, at any W)
    longstraw.json         who wrote it: world size, context-parallel size, optimizer step
    model.safetensors ...  the Trainer's export (rank 0, `from_pretrained`-able; not read on resume)
    scheduler.pt           the LR scheduler (rank 0; every rank's is the same)
    rng_state_R.pth        the Trainer's RNG per process
    trainer_state.json     the Trainer's state: global step, log history, ...

What else continues the same curve, and who restores it: the Trainer (its state, the
scheduler, RNG, and the data position: it skips the micro-batches already trained, so
TRL's seeded RepeatSampler, dealt per data-parallel group, resumes at the next
generation batch); LongStraw's sampling is a function of (seed, optimizer step, prompt),
so the resumed run samples what the uninterrupted one would; TRL's micro-step counter
(`_step`) is set from the global step. Not carried: a generation batch reused over
`num_iterations > 1` optimizer steps; resuming inside such a cycle generates again (what
stock TRL does too), so the curve differs from there.

The trainer's hooks (what `transformers.Trainer` 5.x calls): `_save_checkpoint` ->
`_save_optimizer_and_scheduler` (`save`), `train` -> `_load_from_checkpoint` before the
optimizer exists (`load_model`), `_prepare_for_training` -> `_load_optimizer_and_scheduler`
(`load_optimizer`). A folder without `longstraw_dcp/` (`save_only_model=True`, or written
by stock TRL) goes through the Trainer's own loading.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from longstraw.checkpoint import write_atomic
from longstraw.errors import CheckpointError

logger = logging.getLogger(__name__)

DCP_FOLDER = "longstraw_dcp"
META_FILE = "longstraw.json"
SCHEDULER_FILE = "scheduler.pt"  # transformers' SCHEDULER_NAME
COMPLETE_FILE = "longstraw_complete"
"""Written (atomically, rank 0, after a barrier) once the Trainer's whole checkpoint-N is on disk."""
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR folders


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _torch_optimizer(optimizer):
    """accelerate's `AcceleratedOptimizer` wraps the torch optimizer DCP reads."""
    return getattr(optimizer, "optimizer", optimizer)


def is_sharded(checkpoint: str) -> bool:
    """Whether `checkpoint` holds LongStraw's DCP model and optimizer state."""
    return os.path.isdir(os.path.join(checkpoint, DCP_FOLDER))


def read_meta(checkpoint: str) -> dict:
    """`longstraw.json` of `checkpoint` ({} when absent)."""
    path = os.path.join(checkpoint, META_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------
# save


def save(output_dir: str, model, optimizer, scheduler, *, world: int, context: int, step: int) -> None:
    """Every rank: the model and optimizer state into `output_dir/longstraw_dcp` (DCP);
    rank 0: the scheduler and `longstraw.json`. `model` is the policy (PEFT-wrapped or
    not, FSDP2 or not), `optimizer` the Trainer's (accelerate's wrapper or the torch one)."""
    model_state, optim_state = get_state_dict(model, _torch_optimizer(optimizer))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(output_dir, DCP_FOLDER))
    if _rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))
        with open(os.path.join(output_dir, META_FILE), "w") as f:
            json.dump({"format": 1, "world": world, "context_parallel_size": context, "global_step": step}, f)


# ----------------------------------------------------------------------------
# load


def _check_model_keys(checkpoint: str, model_state: dict) -> None:
    """Every tensor of this model is in the checkpoint with its shape, else a
    `CheckpointError` naming what differs (before anything is loaded)."""
    stored = dcp.FileSystemReader(os.path.join(checkpoint, DCP_FOLDER)).read_metadata().state_dict_metadata
    missing, shapes = [], []
    for name, value in model_state.items():
        meta = stored.get(f"model.{name}")
        if meta is None:
            missing.append(name)
        elif isinstance(value, torch.Tensor) and hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
            shapes.append(f"{name}: checkpoint {tuple(meta.size)}, model {tuple(value.shape)}")
    if missing or shapes:
        what = [f"{len(missing)} parameters missing (first: {missing[:3]})"] if missing else []
        what += [f"shapes differ ({'; '.join(shapes[:3])})"] if shapes else []
        raise CheckpointError(f"the checkpoint {checkpoint} was written for another model: {', '.join(what)}. "
                              "Resume with the model (and PEFT config) that wrote it, or start without "
                              "resume_from_checkpoint")


def load_model(checkpoint: str, model) -> None:
    """Every rank: this run's part of the model from `checkpoint/longstraw_dcp` (any W)."""
    state = {"model": get_model_state_dict(model)}
    _check_model_keys(checkpoint, state["model"])
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, DCP_FOLDER))
    set_model_state_dict(model, state["model"])
    meta = read_meta(checkpoint)
    if meta:
        logger.info("LongStrawGRPOTrainer: model of step %s loaded (written at W = %s, C = %s)",
                    meta.get("global_step"), meta.get("world"), meta.get("context_parallel_size"))


def load_optimizer(checkpoint: str, model, optimizer, scheduler) -> None:
    """Every rank: this run's part of the optimizer state (DCP, any W) and the scheduler."""
    opt = _torch_optimizer(optimizer)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, DCP_FOLDER))
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    set_optimizer_state_dict(model, opt, state["optim"])
    # A checkpoint whose optimizer had other parameter groups (FSDP2's: one per device mesh)
    # loads its moments by name, but torch drops the hyperparameters of groups it cannot
    # match: they are this run's settings, and the LR is the scheduler's (below).
    for group, settings in zip(opt.param_groups, hyper):
        for key, value in settings.items():
            group.setdefault(key, value)
    path = os.path.join(checkpoint, SCHEDULER_FILE)
    if scheduler is not None and os.path.isfile(path):
        groups = len(getattr(scheduler, "base_lrs", ())) or None
        scheduler.load_state_dict(_fit_param_groups(torch.load(path, weights_only=True), groups))
        for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr


def _fit_param_groups(state: dict, groups: int | None) -> dict:
    """A scheduler's state saved with another number of optimizer parameter groups (FSDP2's
    optimizer holds sharded and replicated parameters in groups of their own) fitted to
    `groups`: each per-group list whose entries are all equal is repeated `groups` times.
    Lists that differ per group cannot be mapped: CheckpointError."""
    if groups is None:
        return state
    out = dict(state)
    for key, value in state.items():
        if not isinstance(value, list) or len(value) == groups or not value:
            continue
        if len(set(map(repr, value))) != 1:
            raise CheckpointError(f"the checkpoint's scheduler has {len(value)} parameter groups with different "
                                  f"{key} ({value}); this optimizer has {groups}: they cannot be matched")
        out[key] = [value[0]] * groups
    return out


__all__ = ["DCP_FOLDER", "META_FILE", "is_sharded", "load_model", "load_optimizer", "read_meta", "save"]


def whole_model_state(model) -> dict | None:
    """The model's full state dict (FSDP2 shards gathered, on CPU), for the Trainer's
    `from_pretrained` export, when any parameter is an FSDP2 shard (a DTensor); None
    otherwise (the Trainer saves `model.state_dict()` itself). A collective under FSDP2:
    every rank calls it."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):
        return None
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """(step, name) of every `checkpoint-N` folder of `output_dir`, newest first."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(((int(m.group(1)), n) for n in os.listdir(output_dir) if (m := _CHECKPOINT.match(n))
                   and os.path.isdir(os.path.join(output_dir, n))), reverse=True)


def is_complete(folder: str) -> bool:
    """Whether a `checkpoint-N` folder was written whole (`COMPLETE_FILE`)."""
    return os.path.exists(os.path.join(folder, COMPLETE_FILE))


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-N` of `output_dir` that was written whole (`COMPLETE_FILE`),
    or None when there is none: a first start. The Trainer writes a checkpoint folder in
    place, so a kill inside a save leaves a newest folder that is partial; an unmarked
    folder is never picked (one written before the marker existed: pass its path)."""
    for _, name in _checkpoint_folders(output_dir):
        if is_complete(os.path.join(output_dir, name)):
            return os.path.join(output_dir, name)
    return None


def rotate_complete_checkpoints(output_dir: str, save_total_limit: int | None, best: str | None = None) -> None:
    """`save_total_limit` after the marker (rank 0): the unmarked folders a killed save
    left are removed, then the oldest complete ones beyond the limit, as the Trainer's
    `rotate_checkpoints` would (the newest and `best` are kept). The Trainer's own rotation
    ran inside its save, before the marker, so a kill there could leave no complete
    checkpoint at all."""
    if not save_total_limit or save_total_limit <= 0:
        return
    folders = [os.path.join(output_dir, name) for _, name in _checkpoint_folders(output_dir)]
    complete = [f for f in folders if is_complete(f)]
    keep = set(complete[:save_total_limit]) | ({os.path.normpath(best)} if best else set())
    for folder in folders:
        if os.path.normpath(folder) not in {os.path.normpath(k) for k in keep}:
            logger.info("LongStrawGRPOTrainer: deleting %s (save_total_limit=%d)", folder, save_total_limit)
            shutil.rmtree(folder, ignore_errors=True)


class TrainerCheckpoints:
    """The Trainer's checkpoint hooks for `LongStrawGRPOTrainer` (a mixin ahead of
    `trl.GRPOTrainer`): the model and optimizer state through DCP (`save`, `load_model`,
    `load_optimizer`: any W), the `from_pretrained` export with FSDP2 shards gathered
    (`whole_model_state`). Uses the trainer's `longstraw_engine` and `longstraw_mesh`."""

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """The Trainer's `train`; `resume_from_checkpoint=True` resumes from the newest
        *complete* checkpoint, and starts from step 0 when there is none yet (the same call
        starts a run and restarts it under `torchrun --max-restarts`)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint with its rotation held back, then (every rank done: a
        barrier) rank 0 marks it complete, and only then rotates (`save_total_limit`,
        `rotate_complete_checkpoints`): a kill at any point leaves the last complete one."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # the Trainer's rotate_checkpoints returns at once
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if _rank() == 0 and os.path.isdir(folder):
            write_atomic(os.path.join(folder, COMPLETE_FILE), lambda f: f.write(b"complete\n"))
            rotate_complete_checkpoints(run_dir, limit, self.state.best_model_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank writes its part of the model and optimizer state (DCP); rank 0 the scheduler."""
        mesh = self.longstraw_mesh.mesh
        save(output_dir, self.longstraw_engine.model, self.optimizer, self.lr_scheduler,
                            world=mesh.world, context=mesh.context, step=self.state.global_step)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's `from_pretrained` export; under `longstraw_fsdp` every rank first
        gathers the full state dict (a collective), which rank 0 writes."""
        if state_dict is None:
            state_dict = whole_model_state(self.model)
        super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The model from the checkpoint's DCP state, written at any W (else the Trainer's loading)."""
        if not is_sharded(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_model(resume_from_checkpoint, self.longstraw_engine.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer (DCP, any W) and scheduler, and TRL's micro-step counter."""
        if checkpoint is None or not is_sharded(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_optimizer(checkpoint, self.longstraw_engine.model, self.optimizer, self.lr_scheduler)
        self._step = self.state.global_step * self.args.gradient_accumulation_steps
        if self.num_iterations > 1 and self.state.global_step % self.num_iterations:
            logger.warning("LongStrawGRPOTrainer: resuming inside a num_iterations=%d cycle; its generation batch "
                           "is not in the checkpoint, so it is generated again (the curve differs from here)",
                           self.num_iterations)

