"""`LongStrawGRPOTrainer` on many processes: what changes when W processes form D = W / C
data-parallel groups of C context-parallel ranks (`parallel.mesh`). The trainer in
`trl.py` calls these; the contract is in docs/distributed.md.

* Data. The C ranks of one context-parallel group are one data-parallel replica: TRL's
  RepeatSampler is dealt per group (`DataParallelView.prepare`, accelerate's own
  `prepare_data_loader` with D processes and this group's index), so they get the same
  prompts, and the generation batch is `per_device_train_batch_size x D x steps`.
* Rewards and advantages. TRL gathers the generation batch across processes for its
  advantage statistics ("batch" scaling), metrics and `process_slice`. Inside
  `_generate_and_score_completions` the trainer sees the accelerator through
  `DataParallelView`: its gathers run over the data-parallel group only, so each
  completion is seen once, not once per context-parallel replica.
* Gradients (`parallel.data`). Each group's `engine.step`s use the batch-wide divisors of
  the whole global batch (`global_totals`), so the data-parallel groups' gradients add up
  to the one-process gradient: `reduce_gradients` sums them (one bucketed all-reduce over
  the data-parallel group; TRL's DDP averaging is never engaged, the Trainer's backward is
  skipped).
* Sampling (`parallel.data.sampling_generator`): seeded by the run's seed, the optimizer
  step and the prompt ids, so a run samples the same completions at any W and C.
* Failures (`parallel.data.agreed`): a generation or an update that fails a LongStraw
  check on one rank raises a `DistributedError` naming that rank and its error on every
  rank.
* Metrics (`reduce_metrics`): the `longstraw/` metrics of an optimizer step reduced over
  the data-parallel groups (captures added up, times and bytes their max), so rank 0
  logs the whole run's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from longstraw.parallel.collectives import all_gather, all_reduce_max, all_reduce_sum
from longstraw.parallel.context import ContextParallel


# ----------------------------------------------------------------------------
# the accelerator as TRL's generation code should see it


class DataParallelView:
    """The trainer's accelerator with D data-parallel processes instead of W: gathers
    (tensors and objects) run over this rank's data-parallel group, `process_index` is its
    data-parallel index, and a DataLoader is dealt per data-parallel group. Everything
    else is the accelerator's own."""

    def __init__(self, accelerator, dp: int, data: ContextParallel | None, num_data: int):
        self._accelerator, self._dp, self._data, self._num_data = accelerator, dp, data, num_data

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    @property
    def process_index(self) -> int:
        return self._dp

    @property
    def num_processes(self) -> int:
        return self._num_data

    def gather(self, tensor):
        """accelerate's `gather` over the data-parallel group: each rank's tensor (0-d ones
        as [1]) concatenated along dim 0, in data-parallel order; nested containers too."""
        if isinstance(tensor, (list, tuple)):
            return type(tensor)(self.gather(t) for t in tensor)
        if isinstance(tensor, dict):
            return {k: self.gather(v) for k, v in tensor.items()}
        tensor = tensor[None] if tensor.ndim == 0 else tensor
        return tensor if self._data is None else torch.cat(all_gather(tensor, self._data))

    def gather_object(self, obj):
        """accelerate's `gather_object` over the data-parallel group (lists concatenated)."""
        if self._data is None:
            return obj
        out = [None] * self._data.world
        dist.all_gather_object(out, obj, group=self._data.group)
        return [x for part in out for x in part]

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        total = tensor.clone() if self._data is None else all_reduce_sum(tensor.clone(), self._data)
        return (total / self._num_data if reduction == "mean" else total) * scale

    def prepare(self, *objects, device_placement=None):
        """DataLoaders dealt over the D data-parallel groups (accelerate's `prepare_data_loader`,
        as the accelerator would with a device mesh holding a "cp" dimension); anything else
        goes to the accelerator."""
        from accelerate.data_loader import prepare_data_loader

        out = []
        for obj in objects:
            if not isinstance(obj, torch.utils.data.DataLoader):
                out.append(self._accelerator.prepare(obj, device_placement=device_placement))
                continue
            acc = self._accelerator
            loader = prepare_data_loader(
                obj, acc.device, num_processes=self._num_data, process_index=self._dp, split_batches=acc.split_batches,
                put_on_device=acc.device_placement if device_placement is None else device_placement,
                rng_types=acc.rng_types.copy(), dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
                use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
                non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)
            acc._dataloaders.append(loader)  # the accelerator saves and restores its state with checkpoints
            out.append(loader)
        return out[0] if len(out) == 1 else tuple(out)


@contextlib.contextmanager
def seen_per_data_parallel_group(trainer, view: DataParallelView):
    """Within the block, `trainer.accelerator` is `view` and TRL's module-level `gather` /
    `gather_object` run over the data-parallel group (restored on exit)."""
    import trl.trainer.grpo_trainer as grpo_module

    saved = trainer.accelerator, grpo_module.gather, grpo_module.gather_object
    trainer.accelerator, grpo_module.gather, grpo_module.gather_object = view, view.gather, view.gather_object
    try:
        yield
    finally:
        trainer.accelerator, grpo_module.gather, grpo_module.gather_object = saved


def reduce_metrics(values: dict, sums: tuple, data: ContextParallel | None) -> dict:
    """A metrics dict reduced over the data-parallel group: keys in `sums` added, the rest
    their max (times, bytes). Every rank must pass the same keys."""
    if data is None or not values:
        return dict(values)
    keys = sorted(values)
    sum_part = torch.tensor([float(values[k]) if k in sums else 0.0 for k in keys], dtype=torch.float64)
    max_part = torch.tensor([float(values[k]) if k not in sums else float("-inf") for k in keys], dtype=torch.float64)
    all_reduce_sum(sum_part, data)
    all_reduce_max(max_part, data)
    return {k: float(s if k in sums else m) for k, s, m in zip(keys, sum_part.tolist(), max_part.tolist())}


def check_mesh_settings(args, mesh) -> list[str]:
    """What the trainer refuses on this mesh, one message each (empty: fine)."""
    bad = []
    rows = args.per_device_train_batch_size * args.steps_per_generation
    if mesh.world > 1 and rows % args.num_generations:
        bad.append(f"per_device_train_batch_size x steps_per_generation = {rows} is not a multiple of num_generations="
                   f"{args.num_generations}: on many processes each data-parallel group must get whole prompt groups "
                   "(LongStraw steps one shared prompt at a time); make the per-device batch a multiple of it")
    return bad





__all__ = ["DataParallelView", "check_mesh_settings", "reduce_metrics",
           "seen_per_data_parallel_group"]
