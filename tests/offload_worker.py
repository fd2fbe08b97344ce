"""Worker processes for tests/state/test_offload.py's context-parallel cases (spawned, gloo,
CPU, float64): each rank offloads its own shard of the prompt state (captured divided:
each rank computes its own rows and writes them to host), and its loss,
every parameter gradient, its rollout and its scores equal the on-device
context-parallel engine's (and the single-process one's)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import longstraw as ls
from tests.distributed_worker import _init
from tests.reference import FLOAT32_INTERNALS, FLOAT64, assert_grads_close, grads_of, random_group
from tests.state.test_offload import MODELS, assert_same_step


def run(rank: int, world: int, init_file: str, cases: list[str]) -> None:
    _init(rank, world, init_file)
    try:
        group = random_group(97, 23, [5, 1, 7], seed=3)
        for name in cases:
            if name == "planner":
                check_planner(rank, world)
                continue
            model = MODELS[name]()
            _compare_modes(model, group, name)
            # rollouts and scores of the offloaded shard equal the on-device shard's (the
            # same kernels on the same rows: 1e-12)
            kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3, context_parallel=True)
            prompt = group.prompt
            outs = []
            for extra in ({}, {"state_device": "cpu"}):
                engine = ls.Engine(model, ls.ExecConfig(**kw, **extra))
                rollout = engine.generate(prompt, num_samples=3, max_new_tokens=4,
                                          generator=torch.Generator().manual_seed(7))
                g = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0, 0.5]))
                outs.append((rollout, engine.score(g, state=rollout.state)))
            (a, sa), (b, sb) = outs
            for ra, rb, la, lb, xa, xb in zip(a.responses, b.responses, a.logprobs, b.logprobs, sa, sb):
                assert torch.equal(ra, rb), (name, ra, rb)
                assert (la - lb).abs().max() <= 1e-12 and (xa - xb).abs().max() <= 1e-12, name
    finally:
        dist.destroy_process_group()


def _compare_modes(model, group, name: str) -> None:
    """Both modes: the offloaded context-parallel step equals the on-device one and the
    single process's."""
    for mode in ("detached", "exact"):
        kw = dict(chunk_size=6, attention_block_size=4, shard_block_size=3, mode=mode)
        model.zero_grad(set_to_none=True)
        single = ls.Engine(model, ls.ExecConfig(**kw)).step(group)
        want_single = grads_of(model)
        # against the on-device shard walked replicated, as an offloaded state is (a
        # divided walk routes MoE rows apart: float32 routers round differently)
        engine = assert_same_step(model, group, dict(context_parallel=True, divide_walk=False, **kw))
        state = engine.capture(group.prompt)
        assert state.offload is not None and state.layers[state.offload.order[0]] is not None
        model.zero_grad(set_to_none=True)
        got = engine.step(group)
        assert got.metrics["divided_capture"] == 1.0, name  # each rank writes its own rows to host
        assert got.metrics["divided_walk"] == 0.0, name  # and walked replicated
        assert abs(got.loss - single.loss) <= 1e-9 * abs(single.loss) + 1e-13, (name, mode)
        # HF's own internals (float64 casts made a W = 3 rank without a block send float64
        # where its peers expected float32): the float32-router MoE models to FLOAT32_INTERNALS
        assert_grads_close(grads_of(model), want_single, FLOAT32_INTERNALS if "sparse" in name else FLOAT64)


def check_planner(rank: int, world: int) -> None:
    """Rank 0 (the fullest) moves and holds what the planner's `--offload-state` figures
    for `gpus=world` say, in detached and exact mode."""
    from longstraw.plan import PlanConfig, estimate

    model = MODELS["qwen3"]()
    group = random_group(97, 23, [6, 6], seed=5)
    for mode in ("detached", "exact"):
        engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, state_device="cpu", mode=mode, chunk_size=5,
                                                attention_block_size=3, branch_chunk_size=4))
        metrics = engine.step(group).metrics
        plan = estimate(model.config.to_dict(), PlanConfig(
            prompt_tokens=23, group=2, response_tokens=6, mode=mode, chunk_size=5, attention_block_size=3,
            branch_chunk_size=4, gpus=world, dtype="float64", offload_state=True))["offload"]
        if rank == 0:
            assert metrics["offload_h2d_bytes"] == sum(plan["h2d_bytes"].values()), (mode, metrics, plan)
            assert metrics["offload_d2h_bytes"] == sum(plan["d2h_bytes"].values()), (mode, metrics, plan)
            assert metrics["offload_slot_bytes"] == plan["slot_bytes"], (mode, metrics, plan)
