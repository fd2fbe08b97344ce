"""The planner's term for batched replay (`PlanConfig.replay_batch`: one piece of b x R
tokens over the same prompt state) against the live tensors of a replay-bound step, and
`fit_config`'s search over b (G, 4, 2, 1: the largest that fits)."""

import pytest
import torch

import longstraw as ls
from bench.live_peak import live_tensor_peak
from longstraw.plan import PlanConfig, estimate
from longstraw.shapes import planner_config
from longstraw.tiny import tiny_model
from tests.reference import tiny_mamba, uniform_group

P, G, R, LOGITS = 512, 4, 256, 256  # a short prompt, one long piece: the step's peak is replay's


def _planned(model, b: int) -> float:
    r = estimate(model.config.to_dict(), PlanConfig(prompt_tokens=P, group=G, response_tokens=R, dtype="float32",
                                                    chunk_size=P, grads_during_capture=False, recompute_layers=False,
                                                    logits_chunk_size=LOGITS, replay_batch=b))
    assert r["peak_phase"] == "replay"
    return r["peak_bytes_per_rank"] - r["param_bytes"] - r["optimizer_bytes"]


def _live(model, b: int) -> int:
    group = uniform_group(model.config.vocab_size, P, G, R, seed=0)
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=P, recompute_layers=False, logits_chunk_size=LOGITS,
                                            replay_batch=b))
    model.zero_grad(set_to_none=True)
    return live_tensor_peak(lambda: engine.step(group, ls.GRPOConfig()))


def test_the_planned_replay_of_a_batch_grows_as_the_live_one():
    """What a batch of b = 4 adds to the replay peak over b = 1, planned and live (the
    growth, measured in one process: the absolute in-process peak reads low,
    tests/test_plan_live.py measures it in a fresh one). The planner plans the batch as
    one piece of b x R tokens, which runs 1.23x above the live growth (69.2 MB against
    56.2 MB): on the safe side, but outside issue 46's 10% (not yet explained)."""
    torch.manual_seed(0)
    model = tiny_model("qwen3", dtype=torch.float32)
    live = [_live(model, b) for b in (1, 4)]
    planned = [_planned(model, b) for b in (1, 4)]
    growth_live, growth_planned = live[1] - live[0], planned[1] - planned[0]
    assert growth_live > 0.5 * live[0]  # a batch holds b graphs: the term is not noise
    assert 1.0 <= growth_planned / growth_live <= 1.25, (planned, live)


STEP = dict(prompt_tokens=8192, group=8, response_tokens=128)


def test_fit_config_takes_the_largest_replay_batch_that_fits():
    model = tiny_model("qwen3", dtype=torch.float32)
    roomy = ls.fit_config(model, memory_budget="2GiB", mode="exact", **STEP)
    assert roomy.replay_batch == 8
    assert ls.fit_config(model, memory_budget="2GiB", mode="exact", replay_batch=1, **STEP).replay_batch == 1
    cfg = planner_config(model)

    def replay(b):
        r = estimate(cfg, PlanConfig(dtype="float32", mode="exact", replay_batch=b, chunk_size=1024,
                                     recompute_layers=False, keep_attention_outputs=False, **STEP))
        return r["replay_working_bytes"]
    assert replay(8) > replay(2) > replay(1)  # the term the search weighs
    pieces = ls.fit_config(model, memory_budget="2GiB", mode="exact", branch_chunk_size=64, **STEP)
    assert pieces.replay_batch == 1  # branches in pieces replay alone


@pytest.mark.parametrize("family", ["bamba"])
def test_fit_config_keeps_one_branch_for_families_without_a_batch(family):
    model = tiny_mamba(family, dtype=torch.float32)
    chosen = ls.fit_config(model, memory_budget="2GiB", mode="detached", prompt_tokens=256, group=4,
                           response_tokens=32)
    assert chosen.replay_batch == 1
    ls.Engine(model, chosen)  # accepted
