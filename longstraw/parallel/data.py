"""Data parallelism across context-parallel groups: what W processes in D = W / C groups
(`parallel.mesh`) need beyond the engine's context parallelism, for the trainer
(`integrations/trl.py`) and for a plain loop (examples/torchrun_grpo.py).

* `global_totals`: the batch-wide divisors of the whole global batch, so the groups'
  gradients add up to one process's over that batch;
* `reduce_gradients`: that sum, one bucketed all-reduce over the data-parallel group
  (FSDP2 shards included: ranks with the same context-parallel index hold the same slices);
* `sampling_generator`: sampling as a function of (seed, step, prompt), the same at any W, C;
* `agreed`: a phase that fails a LongStraw check on one rank fails on every rank together.
The design: `longstraw.parallel`; docs/distributed.md.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor

from longstraw.defaults import GRADIENT_BUCKET_BYTES
from longstraw.errors import DistributedError, LongStrawError
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


# ----------------------------------------------------------------------------
# divisors and gradients across data-parallel groups


def process_group_view(group) -> ContextParallel | None:
    """A `ContextParallel` over `group` (what the collectives take), None for no group."""
    return None if group is None else ContextParallel.from_default_group(group)


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


def reduce_gradients(params, data: ContextParallel | None, bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> None:
    """Sum every trainable parameter's `.grad` over the data-parallel group, in place.

    A parameter with a gradient on some rank but not on this one (all its groups skipped
    here) joins with zeros (FSDP2's DTensor gradients: their local shards); one with no gradient on any rank keeps `.grad = None`, as one
    process would. One all-gather of the presence flags, then bucketed all-reduces."""
    if data is None:
        return
    params = [p for p in params if p.requires_grad]
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
    anywhere = torch.stack(all_gather(have, data)).amax(0)  # (n,)
    for p, any_rank in zip(params, anywhere.tolist()):
        if any_rank and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    same_gradient_layout(grads, data, "the data-parallel gradient sum")
    in_buckets(grads, lambda flat: all_reduce_sum(flat, data), bucket_bytes)


# ----------------------------------------------------------------------------
# failures: every rank raises together


_CAUSE_BYTES = 1024  # of each rank's error message carried by the agreement


def _encode(problem: str) -> torch.Tensor:
    data = problem.encode()[: _CAUSE_BYTES - 1]
    out = torch.zeros(_CAUSE_BYTES, dtype=torch.uint8)  # [flag, message bytes...]
    out[0] = 1 if problem else 0
    out[1: 1 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out


def agreed(local, world: ContextParallel | None, what: str):
    """Run `local()` and return its result; on many processes, one all-gather over every
    rank then tells each whether any rank's `local()` raised a `LongStrawError`, and every
    rank raises a `DistributedError` naming the failed ranks and their errors (the failed
    rank's own error chained). No rank waits out the timeout for a peer that raised.

    Only LongStraw's own errors are agreed on: they are raised before any collective of
    the phase (the engine's checks, which the ranks of a context-parallel group already
    agree on), so every rank reaches this all-gather. Anything else (a crash inside a
    collective) propagates at once: the process ends, and its peers' next collective fails
    on the dead peer (`DistributedError` from `parallel.collectives`)."""
    if world is None or world.world == 1:
        return local()
    result, error = None, None
    try:
        result = local()
    except LongStrawError as exc:
        error = exc
    status = all_gather(_encode(f"{type(error).__name__}: {error}" if error else ""), world)
    failed = [(r, bytes(s[1:].tolist()).rstrip(b"\0").decode(errors="replace"))
              for r, s in enumerate(status) if s[0]]
    if failed:
        causes = "; ".join(f"rank {r}: {cause}" for r, cause in failed)
        raise DistributedError(f"{what} failed on rank(s) {[r for r, _ in failed]} of {world.world} ({causes}); "
                               "every rank stops here. Fix that rank's input (each rank's own error says what)"
                               ) from error
    return result
