"""Worker processes for tests/test_plan_comm.py (spawned, gloo, CPU, float64): the bytes the
busiest rank receives in replay (`comm_bytes_replay`, the log-sum-exp merges over the
sharded prompt) equal the planner's `comm.phases.replay` figure, with and without layer
recompute, detached and exact, for a dense, an MLA and a hybrid model."""

from __future__ import annotations

import torch.distributed as dist

import longstraw as ls
from longstraw.plan import PlanConfig, estimate
from tests.distributed_worker import CASES, _init, all_gather_ints
from tests.reference import random_group


def run(rank: int, world: int, init_file: str, out: dict | None = None) -> None:
    _init(rank, world, init_file)
    try:
        group = random_group(97, 41, [4, 4], seed=2)
        for name in ("dense", "mla", "hybrid"):
            model = CASES[name]()
            for mode in ("detached", "exact"):
                for rc in (False, True):
                    model.zero_grad(set_to_none=True)
                    kw = dict(chunk_size=7, attention_block_size=3, recompute_layers=rc, mode=mode)
                    result = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw)).step(group)
                    measured = max(all_gather_ints(result.metrics["comm_bytes_replay"]))
                    plan = estimate(model.config.to_dict(), PlanConfig(prompt_tokens=41, group=2, response_tokens=4,
                                                                       gpus=world, dtype="float64", **kw))
                    planned = plan["comm"]["phases"]["replay"]["bytes"]["context_parallel"]
                    # Traffic counts whole bytes per collective: W = 3's 4/3 rounds down each time
                    assert measured > 0 and abs(measured - planned) <= 0.001 * planned, (name, mode, rc, measured,
                                                                                          planned)
    finally:
        dist.destroy_process_group()


def run_parallelisms(rank: int, world: int, init_file: str) -> None:
    """The expert-parallel, replicated-gradient, data-parallel and FSDP2 checks below, in one process group."""
    _init(rank, world, init_file)
    try:
        check_expert_and_gradient_bytes(world)
        check_data_parallel_bytes(world)
        check_fsdp_bytes(world)
        dist.barrier()  # FSDP2's gloo reduce-scatters are finished on every rank before teardown
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------
# expert-parallel combines, the replicated gradients' broadcast, the data-parallel sum

PHASES = (("capture", "capture"), ("replay", "replay"), ("reverse", "walk"), ("gradients", "gradients"))
"""(the engine's `comm_bytes_*` suffix, the planner's phase)"""


class ExpertTraffic:
    """The bytes this rank receives through `parallel/experts.py`'s collectives (the MoE
    combines), counted apart from the rest of `Traffic` while installed."""

    def __init__(self):
        from longstraw.parallel import experts

        self.module, self.received, self.saved = experts, 0, {}

    def __enter__(self):
        from longstraw.parallel.collectives import Traffic

        def counted(fn):
            def call(*args, **kwargs):
                before = Traffic.received
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.received += Traffic.received - before
            return call

        for name in ("all_gather", "all_reduce_sum", "reduce_scatter_sum"):
            self.saved[name] = getattr(self.module, name)
            setattr(self.module, name, counted(self.saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)


def check_expert_and_gradient_bytes(world: int) -> None:
    """Per phase, the bytes the busiest rank receives equal the planner's: the MoE combines
    under expert parallelism (`plan.experts`), and after a detached step the broadcast
    that makes the replicated gradients the first rank's (`comm.replicated_grad_bytes`);
    for Qwen3-MoE (routing weights in the compute dtype) and GLM-5 (fp32 weights, sparse
    DSA), detached and exact."""
    from tests.reference import tiny_family

    group = random_group(97, 41, [4, 4], seed=2)
    models = {"qwen3_moe": lambda: tiny_family("qwen3_moe", num_hidden_layers=3), "glm_sparse": CASES["glm_sparse"]}
    for name, make in models.items():
        model = make()
        for ep, mode in ((False, "detached"), (True, "detached"), (True, "exact")):  # exact alone: check_planner
            kw = dict(chunk_size=7, attention_block_size=3, mode=mode, expert_parallel=ep)
            model.zero_grad(set_to_none=True)
            engine = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw))
            with ExpertTraffic() as counter:
                engine.capture(group.prompt, exact=mode == "exact")
                captured, counter.received = counter.received, 0
                metrics = engine.step(group).metrics
            plan = estimate(model.config.to_dict(), PlanConfig(prompt_tokens=41, group=2, response_tokens=4,
                                                               gpus=world, dtype="float64", **kw))
            phases = {p: phase["bytes"] for p, phase in plan["comm"]["phases"].items() if "bytes" in phase}
            measured = {p: max(all_gather_ints(metrics["comm_bytes_" + k])) for k, p in PHASES}
            combines = {"capture": max(all_gather_ints(captured)), "step": max(all_gather_ints(counter.received))}
            planned = {"capture": phases["capture"].get("expert_parallel", 0.0),
                       "step": sum(phases[p].get("expert_parallel", 0.0) for p in phases)}
            where = (name, mode, ep, measured, combines, phases)
            for key in ("capture", "step"):  # Traffic counts whole bytes per collective: W = 3's 2/3 round down
                assert abs(combines[key] - planned[key]) <= 1e-3 * planned[key] + 8, where
            for p in ("replay", "walk"):  # merges, DSA candidates, combines; the divided walk
                assert abs(measured[p] - sum(phases[p].values())) <= 1e-3 * sum(phases[p].values()), where
            assert measured["gradients"] == phases["gradients"]["context_parallel"], where  # the broadcast


def check_data_parallel_bytes(world: int) -> None:
    """`parallel.data.reduce_gradients` over the W processes as D = W data-parallel
    replicas: the bytes each rank receives equal the planner's data-parallel all-reduce
    (2 (D-1)/D of the trainable gradients) plus what the planner leaves out: the presence
    flags (one 8-byte flag per trainable tensor) and the 16-byte layout check, from each
    other rank."""
    from longstraw.parallel.collectives import Traffic
    from longstraw.parallel.data import process_group_view, reduce_gradients

    for name in ("dense", "glm_sparse"):
        model = CASES[name]()
        model.zero_grad(set_to_none=True)
        ls.Engine(model, ls.ExecConfig(chunk_size=7)).step(random_group(97, 21, [3, 2], seed=dist.get_rank()))
        params = [p for p in model.parameters() if p.requires_grad]
        before = Traffic.received
        reduce_gradients(params, process_group_view(dist.group.WORLD))
        got = Traffic.received - before
        plan = estimate(model.config.to_dict(), PlanConfig(prompt_tokens=21, group=2, response_tokens=3, gpus=1,
                                                           data_parallel=world, dtype="float64", chunk_size=7))
        planned = plan["comm"]["phases"]["gradients"]["bytes"]["data_parallel"]
        flags = (8 * len(params) + 16) * (world - 1)
        assert planned > 0 and abs(got - flags - planned) <= 1, (name, got, flags, planned)


PREFETCHED = 2
"""Layer gathers a step's FSDP2 backward prefetch adds to the planner's count (measured:
1 at G = 2 one piece, 2 at two or three pieces, tiny qwen3)."""


def check_fsdp_bytes(world: int) -> None:
    """Decoder layers FSDP2-sharded over the W ranks (the context-parallel group): per
    phase, the bytes the busiest rank receives (context-parallel traffic plus FSDP2's
    gathers and reduce-scatters, `parallel.fsdp_traffic.counting_fsdp`) equal the planner's with `shard_params`,
    detached and exact (the divided walk), one piece per branch and pieces of 2 (their
    held pieces' no-grad forward merges too), the layers wrapped as LongStraw runs them
    (`parallel.sharding.shard_model`: resharded after each forward, under one root). FSDP2
    pads each parameter's shard to ceil(rows / W) rows: at W = 3 the gathers carry that
    padding; its backward prefetch gathers up to `PREFETCHED` layers a step more than the
    planner counts."""
    from torch.distributed.device_mesh import init_device_mesh

    from longstraw.parallel.fsdp_traffic import counting_fsdp
    from longstraw.parallel.sharding import shard_model

    model = CASES["dense"]()
    shard_model(model, init_device_mesh("cpu", (world,)))
    layer_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    padded = sum(-(-p.shape[0] // world) * world * p[0].numel() * p.element_size() if p.dim() else 0
                 for p in model.model.layers.parameters())
    group = random_group(97, 41, [4, 4], seed=2)
    for mode, pieces in (("detached", None), ("exact", None), ("detached", 2)):  # pieces: held ones rerun
        kw = dict(chunk_size=7, attention_block_size=3, mode=mode, branch_chunk_size=pieces)
        model.zero_grad(set_to_none=True)
        with counting_fsdp():
            metrics = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw)).step(group).metrics
        plan = estimate(model.config.to_dict(), PlanConfig(prompt_tokens=41, group=2, response_tokens=4, gpus=world,
                                                           dtype="float64", shard_params=True, **kw))
        phases = {p: phase["bytes"] for p, phase in plan["comm"]["phases"].items() if "bytes" in phase}
        measured = {p: max(all_gather_ints(metrics["comm_bytes_" + k])) for k, p in PHASES}
        for p, got in measured.items():
            want = sum(phases[p].values())
            passes = (phases[p].get("fsdp_gather", 0.0) + phases[p].get("fsdp_reduce_scatter", 0.0)) * world / (
                (world - 1) * layer_bytes)  # passes over the layers
            slack = (passes * (padded - layer_bytes) * (world - 1) / world + 1e-3 * want  # FSDP2's padding
                     + PREFETCHED * padded / len(model.model.layers) * (world - 1) / world)
            assert abs(got - want) <= slack, (mode, p, got, want, measured, phases)
