"""One rank of tests/parallel/test_sharding.py (spawned by tests/ranks.spawn): a tiny qwen3
FSDP2-sharded over every rank, the old way (`fully_shard(layer)` for each layer, no root)
or with `parallel.sharding.shard_model`, run through generate, score and one exact step
(context-parallel). It counts the unsharded decoder layers right after every all-gather
FSDP2 waits for (`FSDPParamGroup.wait_for_unshard`, so the peak is seen), at every
layer's forward and at every gradient reaching a layer's output, per phase, and writes
{phase: highest count}, the count after the step and the step's largest gradient error
against one unsharded process (float64, relative to each parameter's largest entry) to
OUT.rank<R>.json."""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

import longstraw as ls
from longstraw.parallel.sharding import decoder_layers, shard_model
from tests.distributed_worker import _init
from tests.reference import grads_of, random_group
from longstraw.tiny import tiny_model


def _unsharded(layers) -> int:
    return sum(g.is_unsharded for layer in layers for g in layer._get_fsdp_state()._fsdp_param_groups)


@contextlib.contextmanager
def counting(layers, seen: dict, where: list):
    """Record the highest number of unsharded layers per phase (`where[0]`)."""
    def note():
        seen[where[0]] = max(seen.get(where[0], 0), _unsharded(layers))

    wait = FSDPParamGroup.wait_for_unshard

    def waited(self, *a, **k):
        out = wait(self, *a, **k)
        note()
        return out

    def on_output(module, args, output):
        note()
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda g: note())

    handles = [layer.register_forward_pre_hook(lambda *_: note()) for layer in layers]
    handles += [layer.register_forward_hook(on_output) for layer in layers]
    FSDPParamGroup.wait_for_unshard = waited
    try:
        yield
    finally:
        FSDPParamGroup.wait_for_unshard = wait
        for h in handles:
            h.remove()


def run_counts(rank: int, world: int, init_file: str, wrap: str, out: str, recompute: tuple = (False,)) -> None:
    """For each `recompute_layers` setting in `recompute`: the counts (OUT.rank<R>.json
    holds {str(recompute): counts}) and the gradients checked against one process."""
    _init(rank, world, init_file)
    try:
        found = {str(rc): _one(world, wrap, rc) for rc in recompute}
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(found, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one(world: int, wrap: str, recompute: bool) -> dict:
    torch.manual_seed(0)
    model = tiny_model("qwen3", dtype=torch.float64, num_hidden_layers=4)
    group = random_group(model.config.vocab_size, 23, [5, 3], seed=3)
    kw = dict(mode="exact", chunk_size=6, attention_block_size=4, shard_block_size=3,
              recompute_layers=True if recompute else False)
    ls.Engine(model, ls.ExecConfig(**kw)).step(group)
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    mesh = init_device_mesh("cpu", (world,))
    if wrap == "old":
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
    else:
        shard_model(model, mesh)
    layers = decoder_layers(model)
    seen, where = {}, ["generate"]
    engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw))

    @contextlib.contextmanager
    def phase(name):
        where[0] = name
        yield

    engine.phase_hook = phase
    with counting(layers, seen, where):
        engine.generate(group.prompt, num_samples=2, max_new_tokens=3, generator=torch.Generator().manual_seed(1))
        where[0] = "score"
        engine.score(group)
        result = engine.step(group)
    seen["after step"] = _unsharded(layers)
    seen["reduce-scatter inputs after step"] = _held_reduce_scatter_inputs(layers)
    seen["walk_recompute_layers"] = result.metrics["walk_recompute_layers"]
    worst = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        ref = want[name]
        worst = max(worst, float((grad - ref).abs().max() / (ref.abs().max() + 1e-300)))
    seen["worst_relative_grad_error"] = worst
    return seen


def _held_reduce_scatter_inputs(layers) -> int:
    """The reduce-scatter inputs FSDP2's shared comm context still holds (its
    `reduce_scatter_states`, which FSDP2's final backward callback clears)."""
    ctx = layers[0]._get_fsdp_state()._comm_ctx
    return len(ctx.reduce_scatter_states)
