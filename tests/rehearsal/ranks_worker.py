"""Workers for tests/rehearsal/test_ranks.py (spawned gloo ranks, CPU): each rank runs the
real step of every case under the same tracker and measured step a rehearsal uses
(`LiveBytes`, `measure_steps`), its collectives counted by the engine's own counter
(`Traffic.by_collective`, FSDP2's through `counting_fsdp`), every collective settled
(`bench.live_peak.settled_collectives`: gloo frees a collective's tensors on its worker
thread, at a time of its own, so an FSDP2 step's real peak came out up to 10% high now
and then; settled, it is the step's own tensors, as on a GPU); then, its gloo group
destroyed, it rehearses itself (`ls.rehearse(..., world_size=W, rank=r)`) in the same
process, and writes both to `out.rank` as JSON."""

from __future__ import annotations

import contextlib
import json

import torch
import torch.distributed as dist

import longstraw as ls
from bench.live_peak import settled_collectives
from longstraw.parallel.fsdp_traffic import counting_fsdp
from longstraw.rehearsal.measure import measure_steps
from longstraw.rehearsal.run import rehearsal_group
from longstraw.rehearsal.tracker import LiveBytes
from longstraw.tiny import tiny_model
from tests.distributed_worker import _init


def exec_config(case: dict) -> ls.ExecConfig:
    """`case["exec"]` (ExecConfig fields) where given, else chunk, mode and expert parallelism."""
    if "exec" in case:
        return ls.ExecConfig(**case["exec"])
    return ls.ExecConfig(chunk_size=case["chunk"], mode=case["mode"], context_parallel=True,
                         expert_parallel=case.get("ep", False))


def _model(case: dict):
    """The case's real model: a tiny family's, or one built from `case["config"]` (an HF
    config dict, random weights of seed 0)."""
    dtype = getattr(torch, case.get("dtype", "float32"))
    if "config" in case:
        import transformers

        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**case["config"])
        config._attn_implementation = "sdpa"
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    return tiny_model(case["family"], dtype=dtype, **case.get("overrides", {})).train()


def real_step(case: dict, world: int) -> dict:
    """This rank's figures of the real step of `case` (float32 or bf16 on gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    from longstraw.rehearsal.ranks import expert_slices
    from longstraw.parallel.sharding import shard_model

    model = _model(case)
    engine = ls.Engine(model, exec_config(case))
    counted = contextlib.nullcontext()
    if case.get("shard"):
        experts = expert_slices(model) if case.get("ep") else None  # as shard_fake: FSDP2 shards them without EP
        shard_model(model, init_device_mesh("cpu", (world,)), ignored_params=experts)
        counted = counting_fsdp()
    group = rehearsal_group(prompt_tokens=case["P"], group=case["G"], response_tokens=case["R"],
                            vocab_size=model.config.vocab_size)
    tracker = LiveBytes("cpu")
    tracker.adopt(list(model.parameters()) + list(model.buffers()))
    with counted, settled_collectives():
        f = measure_steps(engine, group, ls.GRPOConfig(), tracker=tracker)[0]
    dist.barrier()  # FSDP2's gloo reduce-scatters finished on every rank before the next case
    return {"peak": f.peak_bytes, "phases": f.phases, "comm": f.comm_bytes,
            "metrics": {k: v for k, v in f.metrics.items() if k.startswith("comm_bytes_")}}


def rehearsed(case: dict, world: int, rank: int) -> dict:
    model = _model(case)
    r = ls.rehearse(model.config, exec_config(case), prompt_tokens=case["P"], group=case["G"],
                    response_tokens=case["R"], world_size=world, rank=rank, shard_params=case.get("shard", False),
                    device="cpu", dtype=next(model.parameters()).dtype)
    assert r.rank == rank and r.world_size == world and list(r.rank_peaks) == [rank], (r.rank, r.rank_peaks)
    assert not dist.is_initialized()  # the fake group torn down
    return {"peak": r.peak_bytes_per_rank, "phases": r.phases, "comm": r.comm_bytes,
            "metrics": {k: v for k, v in r.steps[0].metrics.items() if k.startswith("comm_bytes_")}}


def run(rank: int, world: int, init_file: str, out: str, cases: list[dict]) -> None:
    _init(rank, world, init_file)
    try:
        real = [real_step(case, world) for case in cases]
    finally:
        dist.destroy_process_group()
    fake = [rehearsed(case, world, rank) for case in cases]
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"real": real, "fake": fake}, f)
