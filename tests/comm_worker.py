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
