"""The default `replay_batch=None` (`defaults.replay_batch_for`): the engine and the planner
choose the same b, b > 1 only where branches can batch (exact mode, under the walk chunk's
graph), bounded by G and `REPLAY_BATCH_MAX`; the planned peak stays flat in G; and the
default's gradients are those of one branch at a time."""

import pytest
import torch

import longstraw as ls
from longstraw import defaults
from longstraw.defaults import replay_batch_for
from longstraw.plan import PlanConfig, estimate
from longstraw.shapes import planner_config
from tests.reference import assert_grads_close, float64_norms, float64_throughout, grads_of, tiny_mamba, tiny_model, \
    tree_group, uniform_group


def test_the_rule_takes_the_setting_and_bounds_its_own_choice():
    rule = dict(batches=True, response_tokens=10, free_tokens=1_000)
    assert replay_batch_for(4, group=8, **rule) == 4
    assert replay_batch_for(16, group=8, **rule) == 8  # never more than G
    assert replay_batch_for(None, group=8, **{**rule, "batches": False}) == 1
    assert replay_batch_for(None, group=1, **rule) == 1
    assert replay_batch_for(None, group=64, **rule) == defaults.REPLAY_BATCH_MAX
    assert replay_batch_for(None, group=5, **rule) == 5
    assert replay_batch_for(None, group=8, batches=True, response_tokens=300, free_tokens=1_000) == 3  # b x R fit
    assert replay_batch_for(None, group=8, batches=True, response_tokens=300, free_tokens=0) == 1  # detached


P, G, R = 256, 8, 16


def _engine_choice(model, group, **kw) -> float:
    model.zero_grad(set_to_none=True)
    kw = {"chunk_size": 128, **kw}
    return ls.Engine(model, ls.ExecConfig(**kw)).step(group, ls.GRPOConfig()).metrics["replay_batch"]


def _planned_choice(model, mode: str, **kw) -> int:
    kw = {"chunk_size": 128, **kw}
    return estimate(planner_config(model), PlanConfig(prompt_tokens=P, group=G, response_tokens=R, dtype="float32",
                                                      mode=mode, **kw))["replay_batch"]


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_the_engine_and_the_planner_choose_the_same_batch(mode):
    torch.manual_seed(0)
    model = tiny_model("qwen3", dtype=torch.float32).train()
    group = uniform_group(model.config.vocab_size, P, G, R, seed=0)
    chosen = _engine_choice(model, group, mode=mode)
    assert chosen == (G if mode == "exact" else 1)  # exact: 8 x 16 tokens under the 128-token walk chunk
    assert chosen == _planned_choice(model, mode)
    if mode == "exact":  # a 32-token walk chunk holds two branches of 16
        assert _engine_choice(model, group, mode=mode, chunk_size=32) == min(G, 32 // R) == _planned_choice(
            model, mode, chunk_size=32)
    assert _engine_choice(model, group, mode=mode, replay_batch=2) == 2 == _planned_choice(model, mode, replay_batch=2)
    assert _engine_choice(model, group, mode=mode, branch_chunk_size=8) == 1  # branches in pieces replay alone
    assert _planned_choice(model, mode, branch_chunk_size=8) == 1
    assert _planned_choice(model, mode, gpus=2) == 1  # context parallelism replays one branch at a time


def test_the_default_keeps_one_branch_where_it_cannot_batch():
    torch.manual_seed(0)
    mamba = tiny_mamba("bamba", dtype=torch.float32).train()
    assert _engine_choice(mamba, uniform_group(mamba.config.vocab_size, 64, 4, 8, seed=0), mode="exact") == 1
    model = tiny_model("qwen3", dtype=torch.float32).train()
    tree = tree_group(["AB", "AC", "AD"], prompt_len=64)
    assert _engine_choice(model, tree, mode="exact") == 1  # a tree's leaves: one at a time


def test_the_planned_peak_stays_flat_in_the_group():
    model = tiny_model("qwen3", dtype=torch.float32)
    peaks = [estimate(planner_config(model), PlanConfig(prompt_tokens=8192, group=g, response_tokens=128,
                                                        dtype="float32", mode="exact", chunk_size=1024))
             for g in (2, 8, 64)]
    assert [p["replay_batch"] for p in peaks] == [2, 8, 8]
    assert len({p["peak_bytes_per_rank"] for p in peaks}) == 1, [p["peak_bytes_per_rank"] for p in peaks]


@pytest.mark.parametrize("mode", ["exact"])
def test_the_default_batch_gives_the_gradients_of_one_branch_at_a_time(mode):
    torch.manual_seed(0)
    model = float64_norms(tiny_model("qwen3"))
    group = uniform_group(model.config.vocab_size, 24, 5, 6, seed=1)
    results = {}
    for b in (None, 1):
        model.zero_grad(set_to_none=True)
        with float64_throughout(model):
            step = ls.Engine(model, ls.ExecConfig(mode=mode, chunk_size=32, replay_batch=b)).step(group)
        results[b] = (step.metrics["replay_batch"], grads_of(model))
    assert results[None][0] == 23 // 6 and results[1][0] == 1  # the 23-token walk chunk holds 3 branches
    assert_grads_close(results[None][1], results[1][1], rel=1e-12)
