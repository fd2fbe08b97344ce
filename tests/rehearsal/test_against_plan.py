"""`longstraw plan ... --rehearse`: the planner's figures beside a rehearsal of the same step."""

import json

import pytest

from longstraw.cli import main

TINY = ["plan", "--model", "tiny-qwen3", "--prompt-tokens", "256", "--group", "2", "--response-tokens", "8",
        "--chunk-size", "128", "--dtype", "fp32"]


def test_plan_rehearse_prints_the_rehearsal_beside_the_planner(capsys):
    assert main(TINY + ["--rehearse", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    reh = report["rehearsal"]
    assert set(reh) >= {"peak_bytes_per_rank", "phases", "comm_bytes", "flops", "host_syncs"}
    assert {"capture", "replay"} <= set(reh["phases"]) and reh["host_syncs"] == 3
    assert reh["flops"]["capture"] > 0 and reh["comm_bytes"] == {}  # one rank: no collective
    # the planner's step is the rehearsed one: first group, optimizer state off
    planned = reh["planner"]
    assert planned["peak_bytes_per_rank"] == max(planned["phases"].values())
    assert planned["peak_bytes_per_rank"] <= report["peak_bytes_per_rank"] - report["optimizer_bytes"]
    assert reh["ratio"]["peak_bytes_per_rank"] == pytest.approx(
        reh["peak_bytes_per_rank"] / reh["planner"]["peak_bytes_per_rank"])
    assert 0.8 < reh["ratio"]["peak_bytes_per_rank"] < 1.25, reh  # tiny qwen3: planner and rehearsal agree


def test_plan_rehearse_refuses_what_it_cannot_rehearse_before_any_work(capsys):
    assert main(TINY + ["--rehearse", "--gpus", "2", "--lora-rank", "4", "--offload-state", "--shard-params",
                        "--expert-parallel", "--weight-dtype", "nf4"]) == 2
    err = capsys.readouterr().err
    assert "--weight-dtype nf4" in err and "bitsandbytes" in err and "--gpus" not in err
    for rehearsed in ("--lora-rank", "--offload-state", "--shard-params", "--expert-parallel"):
        assert rehearsed not in err, rehearsed
    assert main(TINY[:5] + ["--tree", "4x2,4x2", "--rehearse"]) == 2  # two fanned-out levels: one shared prefix only
    assert "--tree beyond one shared segment" in capsys.readouterr().err


CP = ["--attention-block-size", "32"]  # 8 blocks of the prompt: every rank owns some (a divided capture)


@pytest.mark.parametrize("world, mode, flags", [(2, "detached", []), (3, "detached", []), (2, "exact", []),
                                                (2, "exact", ["--recompute-layers", "on"])])
def test_plan_rehearse_gpus_w_compares_each_rank_s_peak_and_received_bytes(capsys, world, mode, flags):
    """`--gpus W`: ranks 0 and W - 1 rehearsed on the fake process group, context parallel.
    The peak (rank 0's, the most prompt rows) within the single-rank tolerance of the
    planner's; the bytes received per phase (the busiest rank's) equal the planner's
    within 1%: capture's (rank W - 1's, the fewest rows), replay's, the gradients'
    broadcast (detached: rank 0 is its source and receives none) or the divided walk's.
    Red before the planner's 'gradients' term: tiny qwen3 W = 2 was 1.31 detached, 1.69 exact;
    and, with the walk's layers recomputed, before the planner counted their forward's
    collectives twice (`plan.traffic.divided_walk_traffic(recompute=True)`)."""
    assert main(TINY + CP + ["--gpus", str(world), "--mode", mode, *flags, "--rehearse", "--json"]) == 0
    reh = json.loads(capsys.readouterr().out)["rehearsal"]
    assert reh["world_size"] == world and sorted(map(int, reh["rank_peaks"])) == [0, world - 1]
    assert reh["rank"] == 0 and 0.8 < reh["ratio"]["peak_bytes_per_rank"] < 1.25, reh["ratio"]
    after = {"detached": "gradients", "exact": "walk"}[mode]
    assert after in reh["phases"] and 0.8 < reh["ratio"][after] < 1.25, reh["ratio"]
    for phase in ("capture", "replay", after):
        assert abs(reh["ratio"][f"comm_{phase}"] - 1) < 0.01, (phase, reh["comm_received"], reh["planner"])
    assert reh["comm_bytes"]["capture"] and reh["comm_received"]["capture"] >= sum(reh["comm_bytes"]["capture"].values())


def _close_comm(reh: dict, phase: str, rel: float) -> bool:
    return abs(reh["ratio"][f"comm_{phase}"] - 1) <= rel


@pytest.mark.parametrize("world, mode", [(2, "detached"), (3, "detached"),
                                         (3, "exact")])
def test_plan_rehearse_shard_params_compares_fsdp2_with_the_planner(capsys, world, mode):
    """`--shard-params`: FSDP2 over the W ranks on the fake model, as `shard_model` wraps a
    real one (the rehearsed rank equals the real gloo rank: tests/rehearsal/test_ranks.py).
    Every phase's peak within 0.8-1.25 of the planner's, the gradients phase (no layer
    gathered any more) within 1%; the bytes received within 1%, replay's within 6% (FSDP2's
    backward prefetch gathers a layer more than planned, `plan/comm.py`). Red before the
    planner counted shard_model's gathers (replay 2.08x, walk 1.27-1.34x the planner's)
    and the gradients phase without the gathered layers (0.86x). Exact mode's divided walk
    within 10% (0.911): red at 0.839 while the planner counted lm_head's walk partial through
    the walk (`plan.peak.walk_reached_grad_elements`)."""
    assert main(TINY + CP + ["--gpus", str(world), "--mode", mode, "--shard-params", "--rehearse", "--json"]) == 0
    reh = json.loads(capsys.readouterr().out)["rehearsal"]
    assert reh["comm_bytes"]["replay"]["fsdp_all_gather"] and reh["comm_bytes"]["replay"]["fsdp_reduce_scatter"]
    for name in ["peak_bytes_per_rank", *reh["phases"]]:
        assert name == "walk" and mode == "detached" or 0.8 < reh["ratio"][name] < 1.25, (name, reh["ratio"])
    if mode == "detached":
        assert abs(reh["ratio"]["gradients"] - 1) < 0.01, reh["ratio"]
    else:
        assert abs(reh["ratio"]["walk"] - 1) <= 0.1, reh["ratio"]
    assert _close_comm(reh, "replay", 0.06), reh["ratio"]
    for phase in ("capture", "gradients" if mode == "detached" else "walk"):
        assert _close_comm(reh, phase, 0.01), (phase, reh["ratio"])


MOE = {"model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
       "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
       "tie_word_embeddings": False}
"""A small Qwen3-MoE (the rehearsed = real check's, tests/rehearsal/test_ranks.py), bf16:
aten._grouped_mm's meta kernel takes no other dtype."""


@pytest.mark.parametrize("flags", [["--expert-parallel"], ["--expert-parallel", "--shard-params"]])
def test_plan_rehearse_expert_parallel_compares_with_the_planner(capsys, tmp_path, flags):
    """`--expert-parallel` (each rank its slice of the experts), alone and with
    `--shard-params`, W = 2, bf16: the peak and every phase within 0.8-1.25 of the
    planner's (measured 0.94-1.03), the bytes received within 1% (replay's with FSDP2
    within 6%, its prefetch). Red before `counting_fsdp` left LongStraw's own
    reduce-scatter alone (capture 1.16x: expert parallelism's combine counted twice)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MOE))
    args = ["plan", "--model", str(config), "--prompt-tokens", "256", "--group", "2", "--response-tokens", "8",
            "--chunk-size", "128", "--dtype", "bf16", *CP, "--gpus", "2", *flags, "--rehearse", "--json"]
    assert main(args) == 0
    reh = json.loads(capsys.readouterr().out)["rehearsal"]
    assert reh["comm_bytes"]["capture"]["reduce_scatter"]  # the divided capture's MoE combine
    for name in ["peak_bytes_per_rank", *[k for k in reh["phases"] if k != "walk"]]:
        assert 0.8 < reh["ratio"][name] < 1.25, (name, reh["ratio"])
    for phase in ("capture", "replay", "gradients"):
        assert _close_comm(reh, phase, 0.06 if phase == "replay" and len(flags) == 2 else 0.01), (phase, reh["ratio"])
    if "--shard-params" in flags:  # FSDP2's backward buffers of the layers' non-expert part: 0.943 before they were planned
        assert abs(reh["ratio"]["replay"] - 1) < 0.03, reh["ratio"]


@pytest.mark.parametrize("world, mode", [(2, "detached"), (2, "exact"), (3, "detached")])
def test_plan_rehearse_shard_params_shards_the_experts_without_expert_parallelism(capsys, tmp_path, world, mode):
    """`--shard-params` alone on an MoE model: FSDP2 shards the experts with the rest of
    each layer, in the rehearsal as in `shard_model(model, mesh)` and the planner. bf16:
    the peak and every phase within 0.8-1.25 of the planner's (measured 0.88-1.02), the
    gradients' broadcast and the bytes received within 1% (replay's within 6%, FSDP2's
    prefetch). Red while the rehearsal left the experts out of FSDP2 whatever the flags
    (W = 2: peak 1.33x, the gradients phase 1.61x, capture's bytes received 0.25x). At
    W = 3 FSDP2 pads the 8 experts to shards of 3 (`plan.experts.fsdp2_expert_padding`):
    replay within 3%, red before the padding was planned (capture's bytes 1.095x)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(MOE))
    args = ["plan", "--model", str(config), "--prompt-tokens", "256", "--group", "2", "--response-tokens", "8",
            "--chunk-size", "128", "--dtype", "bf16", *CP, "--gpus", str(world), "--mode", mode, "--shard-params",
            "--rehearse", "--json"]
    assert main(args) == 0
    reh = json.loads(capsys.readouterr().out)["rehearsal"]
    for name in ["peak_bytes_per_rank", *reh["phases"]]:
        assert name == "walk" and mode == "detached" or 0.8 < reh["ratio"][name] < 1.25, (name, reh["ratio"])
    after = "gradients" if mode == "detached" else "walk"
    if mode == "detached":
        assert abs(reh["ratio"]["gradients"] - 1) < 0.01, reh["ratio"]
    for phase in ("capture", "replay", after):
        assert _close_comm(reh, phase, 0.06 if phase == "replay" else 0.01), (phase, reh["ratio"])
    assert abs(reh["ratio"]["replay"] - 1) < 0.03, reh["ratio"]


def test_plan_rehearse_tree_rehearses_the_shared_segment_once(capsys):
    """`--tree 512x1,16x4`: the responses share their first 512 tokens, replayed once
    (the engine's tree path): the rehearsed peak within the single-rank tolerance of the
    tree's plan, and under 0.7x the flat plan's (`--flat-responses`, which the same
    rehearsal without the shared prefix would be)."""
    tree = ["plan", "--model", "tiny-qwen3", "--prompt-tokens", "64", "--tree", "512x1,16x4", "--chunk-size", "64",
            "--dtype", "fp32", "--json"]
    assert main(tree + ["--flat-responses"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert main(tree + ["--rehearse"]) == 0
    reh = json.loads(capsys.readouterr().out)["rehearsal"]
    assert 0.8 < reh["ratio"]["peak_bytes_per_rank"] < 1.25, reh["ratio"]
    assert reh["peak_bytes_per_rank"] < 0.7 * (flat["peak_bytes_per_rank"] - flat["optimizer_bytes"])


@pytest.mark.slow
def test_plan_fit_rehearse_rehearses_the_chosen_configuration(capsys):
    assert main(TINY + ["--rehearse", "--fit", "--gpu-memory", "8GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fit"] and report["rehearsal"]["fits"]
    assert report["rehearsal"]["planner"]["phases"].keys() >= {"capture", "replay"}


@pytest.mark.slow
def test_planner_replay_matches_the_rehearsal_at_the_paper_s_dimensions():
    """Qwen3.6-27B's own dimensions in bf16 (the preset cut to its first 4 layers: 3 GDN,
    1 attention), P = 16,384, G = 2, R = 2,048 in pieces of 2,048 (two logits chunks):
    the planner's replay peak within 5% of the rehearsal's. Fails on the planner before
    `plan.working.norm_bytes_per_token` / `gated_norm_bytes_per_token` (the norms' float32
    copies in half precision) and the second lm_head gradient transient
    (`plan.memory.head_grad_transient`): rehearsal / planner was 1.096 there."""
    from longstraw.plan.arch import load_model_config
    from longstraw.plan.config import PlanConfig
    from longstraw.rehearsal.against_plan import comparison, rehearse_plan

    _, model, _ = load_model_config("qwen3.6-27b")
    model["num_hidden_layers"] = 4
    c = PlanConfig(prompt_tokens=16384, group=2, response_tokens=2048, branch_chunk_size=2048, chunk_size=4096,
                   mode="detached", gpus=1, dtype="bf16")
    entry = comparison(model, c, rehearse_plan(model, c))
    assert abs(entry["ratio"]["replay"] - 1) <= 0.05, entry["ratio"]


@pytest.mark.parametrize("topk", [8, 256])  # sparse DSA (candidates too), and top-k over every position
def test_planned_mla_replay_bytes_are_the_rehearsed_ones_in_bf16(topk):
    """GLM-5's replay merges over the sharded prompt at W = 2 in bf16, with and without layer
    recompute: the planner's bytes equal the rehearsed collectives'. The gloo check
    (tests/test_plan_comm.py) runs float64, where the model dtype is the accumulation dtype;
    in bf16 the backward's sum of the absorbed queries' gradient is half as wide. Fails on
    the planner before stop 55 (its MLA pass read 2 (H (kv_lora + 1) + kv_lora) in float32:
    125,952 B planned against 82,944 rehearsed here, 320.5 GiB against 248.0 for GLM-5.2)."""
    import torch

    import longstraw as ls
    from longstraw.plan import PlanConfig, estimate
    from longstraw.tiny import tiny_model

    config = tiny_model("glm_moe_dsa", index_topk=topk).config
    for rc in (False, True):
        kw = dict(chunk_size=16, mode="detached", attention_block_size=8, recompute_layers=rc)
        reh = ls.rehearse(config, ls.ExecConfig(context_parallel=True, **kw), prompt_tokens=48, group=2,
                          response_tokens=6, device="cpu", dtype=torch.bfloat16, world_size=2)
        plan = estimate(config.to_dict(), PlanConfig(prompt_tokens=48, group=2, response_tokens=6, gpus=2,
                                                     dtype="bfloat16", **kw))
        assert sum(reh.comm_bytes["replay"].values()) == plan["comm"]["phases"]["replay"]["bytes"]["context_parallel"]


def test_plan_rehearse_steps_gives_each_step_s_peak(capsys):
    """`--rehearse-steps 2`: two steps rehearsed, each one's peak in "step_peaks" (no leak:
    the second peaks as the first); detached mode's empty "walk" is not shown."""
    assert main(TINY + ["--rehearse", "--rehearse-steps", "2", "--json"]) == 0
    reh = json.loads(capsys.readouterr().out)["rehearsal"]
    first, second = reh["step_peaks"]
    assert reh["peak_bytes_per_rank"] == max(first, second) and abs(second - first) <= 0.005 * first
    assert len(reh["ops"]) == 2 and "walk" not in reh["phases"]
    assert main(TINY + ["--rehearse", "--rehearse-steps", "0"]) == 2  # a clear error, not an empty rehearsal


def test_plan_rehearse_allow_position_overflow_reaches_the_rehearsed_engine():
    from longstraw.plan.config import PlanConfig
    from longstraw.rehearsal.against_plan import rehearsal_exec_config

    c = PlanConfig(prompt_tokens=256, group=2, response_tokens=8)
    assert not rehearsal_exec_config(c).allow_position_overflow
    assert rehearsal_exec_config(c, allow_position_overflow=True).allow_position_overflow
@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_plan_rehearse_lora_rehearses_the_planned_adapters(capsys, targets):
    """`--lora-rank 8`: the rehearsal trains the planner's adapters (base frozen): its peak
    within the single-rank tolerance of the planner's, and below the full-training
    rehearsal's by about the full gradients (the weights' bytes) less the adapters'."""
    lora = ["--mode", "exact", "--lora-rank", "8", "--lora-targets", targets, "--rehearse", "--json"]
    assert main(TINY + lora) == 0
    report = json.loads(capsys.readouterr().out)
    reh = report["rehearsal"]
    assert 0.8 < reh["ratio"]["peak_bytes_per_rank"] < 1.25 and 0.8 < reh["ratio"]["walk"] < 1.25, reh["ratio"]
    assert main(TINY + ["--mode", "exact", "--rehearse", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["rehearsal"]
    saved = full["peak_bytes_per_rank"] - reh["peak_bytes_per_rank"]
    assert saved > 0.8 * report["param_bytes"], (saved, report["param_bytes"])


@pytest.mark.parametrize("offload", [dict(offload_state=True), dict(offload_snapshots=True)])
def test_rehearsed_host_bytes_are_the_planner_s(offload):
    """Tiny qwen3_5 in exact mode, state offload or snapshot offload: the rehearsal's host
    bytes (`host_tensor`: the arenas, the offloaded snapshots) equal the planner's host
    figure, and its device capture peak the planner's within 10% (as without offload).
    Red before the planner counted one slot for one staged layer and the gradient sinks
    only after capture: capture was 0.77 of the planner's."""
    from longstraw.plan.config import PlanConfig
    from longstraw.plan.estimate import estimate
    from longstraw.rehearsal.against_plan import comparison, rehearse_plan
    from longstraw.tiny import TINY_CONFIGS

    model = dict(TINY_CONFIGS["qwen3_5"])
    c = PlanConfig(prompt_tokens=2048, group=4, response_tokens=256, chunk_size=256, gpus=1, dtype="fp32",
                   mode="exact", **offload)
    reh = rehearse_plan(model, c)
    entry = comparison(model, c, reh)
    assert entry["planner"]["host_bytes"] > 0 and abs(entry["ratio"]["host_bytes"] - 1) < 0.01, entry["ratio"]
    assert 0.9 < entry["ratio"]["capture"] < 1.1 and 0.85 < entry["ratio"]["peak_bytes_per_rank"] < 1.1, entry["ratio"]
    if c.offload_state:
        planned = estimate(model, c)["offload_slot_bytes_per_rank"]
        assert reh.steps[0].metrics["offload_slot_bytes"] == planned


@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_the_planner_s_lora_graph_saving_is_the_rehearsed_one(targets):
    """Every capture graph kept (exact, tiny qwen3, fp32): what LoRA takes off the capture
    peak against full training, planned (`plan.working.lora_graph_saving`, the adapters'
    weights added) equals what it takes off the rehearsed one within 5%. Red without
    that term: the planner took nothing off (its LoRA capture was the full one plus the
    adapters: planned / rehearsed saving -0.02 on attention, -0.14 on all-linear)."""
    from longstraw.plan.config import PlanConfig
    from longstraw.rehearsal.against_plan import comparison, rehearse_plan

    drops = {}
    for lora in (None, 16):
        c = PlanConfig(prompt_tokens=1024, group=2, response_tokens=32, chunk_size=256, gpus=1, dtype="fp32",
                       mode="exact", keep_graph_bytes=10**9, lora_rank=lora, lora_targets=targets)
        entry = comparison("tiny-qwen3", c, rehearse_plan("tiny-qwen3", c))
        drops[lora] = (entry["planner"]["phases"]["capture"], entry["phases"]["capture"])
    planned, rehearsed = (drops[None][i] - drops[16][i] for i in (0, 1))
    assert rehearsed > 0 and abs(planned / rehearsed - 1) < 0.05, (planned, rehearsed)


def test_plan_rehearse_workers_must_be_positive(capsys):
    """`--rehearse-workers 0` (or a word) is refused by the argument parser, before any work."""
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as exit_:
            main(TINY + ["--rehearse", "--rehearse-workers", bad])
        assert exit_.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err


def test_plan_rehearse_workers_default_to_the_cpus_from_a_long_prompt(monkeypatch):
    """No `--rehearse-workers`: one process below P = 262,144, the machine's CPUs from it."""
    import longstraw.cli as cli
    from longstraw.plan.config import PlanConfig

    monkeypatch.setattr(cli.os, "cpu_count", lambda: 6)
    assert cli._default_workers(PlanConfig(prompt_tokens=cli.PARALLEL_REHEARSAL_FROM - 1, group=2,
                                           response_tokens=8)) == 1
    assert cli._default_workers(PlanConfig(prompt_tokens=cli.PARALLEL_REHEARSAL_FROM, group=2,
                                           response_tokens=8)) == 6


@pytest.mark.parametrize("recompute", [True, False])
def test_planned_moe_backward_is_the_rehearsed_one(recompute):
    """An MoE layer's backward through HF's grouped_mm combine holds three [T k, H] rows in
    the routing weights' float32 beside the layer's graph (`plan.experts.moe_backward_bytes_per_token`).
    Tiny glm_moe_dsa widened so that moment is replay's peak (H = 512, k = 8 of 16 experts,
    R = 1,024 in one piece, bf16): the planner's replay within 5% of the rehearsal's, with
    and without layer recompute. Red with recompute before the term (rehearsed / planned
    1.213; GLM-5.2 at the paper's P on 32 ranks 1.058, 1.004 after)."""
    import torch

    import longstraw as ls
    from longstraw.plan import PlanConfig, estimate
    from longstraw.tiny import tiny_model

    config = tiny_model("glm_moe_dsa", hidden_size=512, num_experts_per_tok=8, n_routed_experts=16,
                        moe_intermediate_size=16).config
    kw = dict(chunk_size=64, mode="detached", recompute_layers=recompute)
    reh = ls.rehearse(config, ls.ExecConfig(**kw), prompt_tokens=64, group=2, response_tokens=1024, device="cpu",
                      dtype=torch.bfloat16)
    plan = estimate(config.to_dict(), PlanConfig(prompt_tokens=64, group=2, response_tokens=1024, gpus=1,
                                                 dtype="bfloat16", grads_during_capture=False, **kw))
    planned = plan["breakdown"]["phase_peak_bytes"]["replay"] - plan["optimizer_bytes"]
    assert abs(reh.phases["replay"] / planned - 1) <= 0.05, reh.phases["replay"] / planned
