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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from longstraw.errors import CheckpointError

logger = logging.getLogger(__name__)

DCP_FOLDER = "longstraw_dcp"
META_FILE = "longstraw.json"
SCHEDULER_FILE = "scheduler.pt"  # transformers' SCHEDULER_NAME


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
    set_optimizer_state_dict(model, opt, state["optim"])
    path = os.path.join(checkpoint, SCHEDULER_FILE)
    if scheduler is not None and os.path.isfile(path):
        scheduler.load_state_dict(torch.load(path, weights_only=True))


__all__ = ["DCP_FOLDER", "META_FILE", "is_sharded", "load_model", "load_optimizer", "read_meta", "save"]
