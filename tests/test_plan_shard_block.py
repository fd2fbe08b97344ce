"""The planner's deal block is the engine's (issue 43 item 6f): `PlanConfig.shard_block_size`
(`ExecConfig.shard_block_size`, `--shard-block-size`) deals the prompt positions over the
ranks as the engine's `capture.rank_shard` does, so whether every rank owns a block (a
divided capture) and the fullest rank's state follow it; `fit_config` plans a pinned one."""

from types import SimpleNamespace

import pytest

import longstraw as ls
from longstraw.engine.capture import every_rank_owns_a_block, rank_shard
from longstraw.plan import PlanConfig, estimate
from longstraw.plan.fit import exec_config, flags

P, W = 3000, 4  # 2,999 captured positions: 3 blocks of 1,024 (rank 3 owns none), 12 of 256


@pytest.mark.parametrize("shard_block", [None, 256])
def test_the_planned_deal_is_the_engines(shard_block):
    engine = SimpleNamespace(cp=SimpleNamespace(rank=0, world=W),
                             config=ls.ExecConfig(context_parallel=True, shard_block_size=shard_block))
    c = PlanConfig(prompt_tokens=P, gpus=W, group=2, response_tokens=64, shard_block_size=shard_block)
    r = estimate("qwen3-8b", c)
    assert r["divided_capture"] == every_rank_owns_a_block(engine, P - 1) == (shard_block == 256)
    block = rank_shard(engine).block
    fullest = max(len([p for p in range(P) if (p // block) % W == k]) for k in range(W))
    per_token = estimate("qwen3-8b", PlanConfig(prompt_tokens=P, group=2, response_tokens=64))["state_bytes_total"] / P
    assert r["state_bytes_per_rank"] == pytest.approx(fullest * per_token)
    assert exec_config(c)["shard_block_size"] == shard_block
    assert ("--shard-block-size" in flags(c)) == (shard_block is not None)
