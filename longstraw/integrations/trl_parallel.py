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
* Gradients. Each group's `engine.step`s use the batch-wide divisors of the whole global
  batch (`global_totals`), so the data-parallel groups' gradients add up to the one-process
  gradient: `reduce_gradients` sums them (one bucketed all-reduce over the data-parallel
  group; TRL's DDP averaging is never engaged, the Trainer's backward is skipped).
* Sampling. `sampling_generator(seed, step, prompt)`: a generator seeded by the run's
  seed, the optimizer step and the prompt ids, so a run samples the same completions at
  any W and C.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist

from longstraw.errors import DistributedError
from longstraw.group import BatchTotals
from longstraw.parallel.collectives import all_gather, all_reduce_max, all_reduce_sum, in_buckets
from longstraw.parallel.context import ContextParallel
from longstraw.parallel.gradients import same_gradient_layout


def sampling_generator(seed: int, step: int, prompt: torch.Tensor) -> torch.Generator:
    """A CPU generator seeded by (run seed, optimizer step, prompt ids [P]): the same
    completions for this prompt at this step at any W and C (a prompt twice in one
    generation batch samples the same group twice)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{int(seed)}:{int(step)}:".encode())
    digest.update(prompt.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


def process_group_view(group) -> ContextParallel | None:
    """A `ContextParallel` over `group` (what the collectives take), None for no group."""
    return None if group is None else ContextParallel.from_default_group(group)


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


# ----------------------------------------------------------------------------
# divisors and gradients across data-parallel groups


def global_totals(groups, data: ContextParallel | None) -> BatchTotals:
    """`BatchTotals` of the whole global batch: this rank's `groups` and every other
    data-parallel group's (sums of sequences and loss tokens, max of response lengths)."""
    groups = list(groups)
    local = BatchTotals.of(groups)
    if data is None:
        return local
    tokens = sum(g.loss_tokens for g in groups)  # unclamped: the batch's clamp is applied once
    sums = all_reduce_sum(torch.tensor([float(local.num_sequences), float(tokens)], dtype=torch.float64), data)
    longest = all_reduce_max(torch.tensor([float(local.max_response_tokens)], dtype=torch.float64), data)
    return BatchTotals(num_sequences=int(sums[0]), num_tokens=max(1, int(sums[1])),
                       max_response_tokens=int(longest[0]))


def reduce_gradients(params, data: ContextParallel | None, bucket_bytes: int = 32 << 20) -> None:
    """Sum every trainable parameter's `.grad` over the data-parallel group, in place.

    A parameter with a gradient on some rank but not on this one (all its groups skipped
    here) joins with zeros; one with no gradient on any rank keeps `.grad = None`, as one
    process would. One all-gather of the presence flags, then bucketed all-reduces."""
    if data is None:
        return
    params = [p for p in params if p.requires_grad]
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
    anywhere = torch.stack(all_gather(have, data)).amax(0)  # (n,)
    for p, any_rank in zip(params, anywhere.tolist()):
        if any_rank and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    same_gradient_layout(grads, data, "the data-parallel gradient sum")
    in_buckets(grads, lambda flat: all_reduce_sum(flat, data), bucket_bytes)


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


__all__ = ["DataParallelView", "DistributedError", "check_mesh_settings", "global_totals", "process_group_view",
           "reduce_gradients", "reduce_metrics", "sampling_generator", "seen_per_data_parallel_group"]
