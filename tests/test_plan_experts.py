"""The planner's model of expert parallelism (`plan/experts.py`): bytes by hand on a small
Qwen3-MoE config, the GLM-5.2 paper run it makes fit, and its errors. No model is built."""

import json

import pytest

from longstraw.cli import main
from longstraw.errors import ConfigError
from longstraw.plan import PlanConfig, estimate

# 2 layers, H = 64, 8 experts of width 32, k = 2, 4 heads of 16 (2 KV heads), vocab 1,000
SMALL = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "intermediate_size": 128, "tie_word_embeddings": False,
         "max_position_embeddings": 65536, "torch_dtype": "float32"}
EXPERTS = 2 * 8 * (64 * 32 * 2 + 32 * 64)  # 98,304 elements: 2 layers x 8 experts x (gate, up, down)
LAYER = (64 * 64 + 64 * 32 * 2 + 64 * 64) + (2 * 64 + 2 * 16 + 64 * 8)  # q/k/v/o + norms, q/k norms, router


def plan(**kw):
    kw = {"prompt_tokens": 4096, "group": 4, "response_tokens": 256, "gpus": 4, "dtype": "float32", **kw}
    return estimate(dict(SMALL), PlanConfig(**kw))


def test_each_rank_holds_its_experts_slice_and_gathers_only_the_rest_by_hand():
    whole = plan()
    ep = plan(expert_parallel=True)
    assert ep["param_bytes"] == pytest.approx(whole["param_bytes"] - EXPERTS * 4 * (1 - 2 / 8))  # 2 of 8 experts
    sharded = plan(shard_params=True)
    both = plan(shard_params=True, expert_parallel=True)
    assert both["param_bytes"] == pytest.approx(sharded["param_bytes"] - EXPERTS * 4 / 4 + EXPERTS * 4 * 2 / 8)
    assert both["gathered_param_bytes"] == 2 * LAYER * 4 == 103_680  # two layers' non-expert weights
    assert sharded["gathered_param_bytes"] == 2 * (LAYER + EXPERTS // 2) * 4  # whole layers, experts included
    assert not whole["expert_parallel"] and whole["expert_comm_bytes_per_rank"] == 0


def test_uneven_experts_count_the_fullest_ranks_slice():
    # 8 experts over 3 ranks: the fullest holds 3
    assert plan(gpus=3, expert_parallel=True)["experts"]["experts_per_rank"] == 3
    three = plan(gpus=3, expert_parallel=True)["param_bytes"]
    assert three == pytest.approx(plan(gpus=3)["param_bytes"] - EXPERTS * 4 * (1 - 3 / 8))


def test_combine_traffic_per_token_and_per_step_by_hand():
    r = plan(expert_parallel=True, mode="exact", recompute_layers=False)
    per = r["experts"]["bytes_per_token_per_moe_layer"]
    # W = 4, H = 64, fp32, k = 2: ring all-reduce 2 (W-1)/W = 1.5 of [H]; gather/scatter (W-1) = 3 of a row
    assert per == {"replicated_forward": 1.5 * 256, "replicated_backward": 1.5 * (256 + 8),
                   "divided_forward": 3 * (512 + 24), "divided_backward": 3 * (512 + 8)}
    assert r["divided_capture"] and r["divided_walk"]
    own = 1024  # 4,096 positions in blocks of 1,024 over 4 ranks
    replay = 4 * 256  # G x R replicated tokens
    # capture and the walk forward through both MoE layers; the walk's backward only through
    # the first (the last layer's output reaches no root of a walk chunk; measured in
    # tests/comm_worker.py, as fp32 routing weights' bytes are: Qwen3's are the compute dtype's)
    want = (2 * (replay * (per["replicated_forward"] + per["replicated_backward"]) + 2 * own * per["divided_forward"])
            + 1 * own * per["divided_backward"])
    assert r["expert_comm_bytes_per_rank"] == pytest.approx(want)


def test_replay_graph_keeps_every_tokens_rows_and_the_combined_output():
    """HF's grouped_mm / batched_mm experts forward allocates all k rows per token, the other
    ranks' zeroed; the combine adds its output [H] per MoE layer and token."""
    whole = plan(recompute_layers=False)
    ep = plan(recompute_layers=False, expert_parallel=True)
    H = 64
    grow = 2 * H * 4  # 2 MoE layers, fp32
    assert ep["breakdown"]["replay"]["graph_bytes_per_token"] - whole["breakdown"]["replay"]["graph_bytes_per_token"] \
        == pytest.approx(grow)


def test_the_paper_glm_5_2_run_fits_with_expert_parallelism(capsys):
    args = ["plan", "--model", "glm-5.2", "--prompt-tokens", "2088960", "--group", "8", "--response-tokens", "8192",
            "--gpus", "32", "--branch-chunk-size", "1024", "--lora-rank", "8", "--offload-state", "--shard-params",
            "--recompute-layers", "on",  # asked for: the default no longer trades time for memory unasked
            "--chunk-size", "1024"]  # a divided capture's MoE piece gathers W x chunk rows, k pairs each in HF's
    # grouped_mm (`plan.experts.grouped_mm_bytes_per_choice`): at W = 32 chunks of 4,096 do not fit (123.7 GiB)
    assert main(args + ["--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(args + ["--expert-parallel", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert not before["fits"] and after["fits"] and after["divided_capture"]
    assert after["peak_bytes_per_rank"] <= 0.85 * 96 * 2**30 < before["peak_bytes_per_rank"]
    assert after["gathered_param_bytes"] < before["gathered_param_bytes"] / 20
    assert main(args + ["--expert-parallel"]) == 0
    assert "8 of 256 experts per rank" in capsys.readouterr().out


def test_bad_expert_parallel_plans_are_clear_errors():
    with pytest.raises(ConfigError, match="gpus >= 2"):
        plan(gpus=1, expert_parallel=True)
    with pytest.raises(ConfigError, match="no routed experts"):
        estimate("qwen3-8b", PlanConfig(prompt_tokens=4096, group=2, response_tokens=64, gpus=2, expert_parallel=True))


def test_a_transformers_5_qwen3_moe_config_is_read():
    """transformers 5 writes Qwen3-MoE's expert count as `num_local_experts` (a hub
    config.json says `num_experts`): `ls.fit_config` and the engine's planner seam pass
    `config.to_dict()`, so both names plan the same."""
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in SMALL.items() if k not in ("model_type", "torch_dtype")}
    cfg = transformers.Qwen3MoeConfig(**fields).to_dict()
    assert "num_experts" not in cfg and cfg["num_local_experts"] == SMALL["num_experts"]
    got, want = estimate(cfg, PlanConfig(prompt_tokens=4096, group=4, response_tokens=256, gpus=4, dtype="float32",
                                          expert_parallel=True)), plan(expert_parallel=True)
    assert got["experts"] == want["experts"] and got["param_bytes"] == want["param_bytes"]
