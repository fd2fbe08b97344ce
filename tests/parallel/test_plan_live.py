"""The planner against live tensors under context parallelism (gloo, CPU, fp32, W = 2,
spawned: fresh processes). A replay-bound detached step (P = 512, G = 2, R = 1,024 in one
piece, logits chunk 256, no layer recompute): each rank's live-tensor peak
(`bench.live_peak`) against the planner's peak above the weights within 10%, for tiny
glm_moe_dsa with expert parallelism (without, and qwen3 / qwen3_5: -m slow). The
context-parallel term is `plan.working.context_parallel_bytes_per_token`."""

from __future__ import annotations

import json

import pytest
import torch
from tests.ranks import spawn

P, G, R, LOGITS, WORLD = 512, 2, 1024, 256, 2


def _measure(rank: int, world: int, init: str, out: str, family: str, eps: list) -> None:
    """One rank: the live-tensor peak of one step per `expert_parallel` in eps, to out.rank."""
    import longstraw as ls
    from bench.live_peak import live_tensor_peak
    from longstraw.tiny import tiny_model
    from tests.distributed_worker import _init
    from tests.reference import uniform_group

    _init(rank, world, init)
    peaks = {}
    for ep in eps:
        torch.manual_seed(0)
        model = tiny_model(family, dtype=torch.float32)
        group = uniform_group(model.config.vocab_size, P, G, R, seed=0)
        engine = ls.Engine(model, ls.ExecConfig(chunk_size=P, recompute_layers=False, logits_chunk_size=LOGITS,
                                                context_parallel=True, expert_parallel=ep))
        peaks[str(ep)] = live_tensor_peak(lambda: engine.step(group, ls.GRPOConfig()))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(peaks, f)
    torch.distributed.destroy_process_group()


def planned(family: str, ep: bool) -> float:
    """The planner's peak per rank above the weights and optimizer for the measured step."""
    from longstraw.plan import PlanConfig, estimate
    from longstraw.tiny import tiny_model

    cfg = tiny_model(family, dtype=torch.float32).config.to_dict()
    plan = estimate(cfg, PlanConfig(prompt_tokens=P, group=G, response_tokens=R, dtype="float32", chunk_size=P,
                                    grads_during_capture=False, recompute_layers=False, logits_chunk_size=LOGITS,
                                    gpus=WORLD, expert_parallel=ep))
    assert plan["peak_phase"] == "replay"
    return plan["peak_bytes_per_rank"] - plan["param_bytes"] - plan["optimizer_bytes"]


def check(tmp_path, family: str, eps: list) -> None:
    out = str(tmp_path / "peak")
    spawn(_measure, args=(WORLD, str(tmp_path / "init"), out, family, eps), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        with open(f"{out}.{rank}") as f:
            peaks = json.load(f)
        for ep in eps:
            ratio = planned(family, ep) / peaks[str(ep)]
            print(f"{family} rank {rank} expert_parallel {ep}: planned / measured {ratio:.3f}")
            assert abs(ratio - 1) <= 0.10, (family, rank, ep, ratio, peaks)


def test_planner_matches_live_tensors_under_context_and_expert_parallelism(tmp_path):
    """The context-parallel and the expert-parallel terms together (context parallelism
    alone, for each family: -m slow)."""
    check(tmp_path, "glm_moe_dsa", [True])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa"])
def test_planner_matches_live_tensors_under_context_parallelism(tmp_path, family):
    check(tmp_path, family, [False])
