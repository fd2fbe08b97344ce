"""The capacity planner: published figures it must reproduce exactly, its CLI, its errors,
and the directions its estimates must move in. No model is built (fast)."""

import json

import pytest

from longstraw.cli import main
from longstraw.errors import ConfigError, UnsupportedModelError
from longstraw.plan import PlanConfig, estimate, load_presets, parse_bytes

GiB, MiB = 2**30, 2**20
KEYS = ("state_bytes_per_token", "state_bytes_fixed", "state_bytes_total", "param_bytes", "grad_bytes",
        "optimizer_bytes", "replay_working_bytes", "capture_working_bytes", "peak_bytes_per_rank", "fits",
        "estimated_time_s_detached", "estimated_time_s_exact")


def plan(model="qwen3-8b", **kw):
    kw = {"prompt_tokens": 131072, "group": 8, "response_tokens": 1024, **kw}
    return estimate(model, PlanConfig(**kw))


def run_cli(capsys, *args):
    code = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------- exact figures


def test_glm_5_2_state_matches_paper():
    r = plan("glm-5.2", prompt_tokens=2_097_152, dtype="bf16")
    assert r["state_bytes_per_token"] == 95_232 == (512 + 64) * 2 * 78 + 128 * 2 * 21
    assert r["state_bytes_fixed"] == 0
    assert r["state_bytes_total"] == 199_715_979_264 == 186 * GiB
    assert r["layer_counts"] == {"mla": 78, "dsa_indexer": 21, "moe": 75}
    # the paper's 5.8125 GiB per rank over 32 ranks
    assert plan("glm-5.2", prompt_tokens=2_097_152, gpus=32)["state_bytes_per_rank"] == 5.8125 * GiB


def test_qwen3_6_27b_state_matches_paper():
    r = plan("qwen3.6-27b", prompt_tokens=2_097_152, dtype="bf16")
    assert r["state_bytes_per_token"] == 65_536 == 16 * 4 * 256 * 2 * 2
    gdn = r["breakdown"]["state"]
    assert gdn["recurrent_fixed"] == 144 * MiB == 48 * 48 * 128 * 128 * 4
    assert gdn["conv_tail_fixed"] == 48 * (2 * 16 * 128 + 48 * 128) * 3 * 2  # [conv_dim, kernel-1] in bf16
    assert r["state_bytes_fixed"] == 144 * MiB + gdn["conv_tail_fixed"]
    assert r["state_bytes_total"] == 128 * GiB + r["state_bytes_fixed"]
    assert r["layer_counts"] == {"full_attention": 16, "gated_deltanet": 48}


def test_qwen3_6_27b_lora_count_matches_paper():
    # NF4 QLoRA at rank 16 on every linear layer: the paper's 116.7M trainable parameters
    r = plan("qwen3.6-27b", lora_rank=16, lora_targets="all-linear", weight_dtype="nf4")
    assert r["trainable_parameters"] == 116_727_808
    assert plan("qwen3.6-27b", lora_rank=16)["trainable_parameters"] < 116_727_808 / 2  # attention only


@pytest.mark.parametrize("name", sorted(load_presets()))
def test_parameter_count_matches_published(name):
    r = plan(name)
    published = load_presets()[name]["num_parameters"]
    assert r["num_parameters"] == pytest.approx(published, rel=0.01)


def test_tiny_preset_is_the_tiny_model():
    from longstraw.tiny import TINY_CONFIGS

    preset = load_presets()["tiny-qwen3"]["config"]
    assert {k: preset[k] for k in TINY_CONFIGS["qwen3"]} == TINY_CONFIGS["qwen3"]
    r = plan("tiny-qwen3", prompt_tokens=32768, response_tokens=256)
    assert r["dtype"] == "float32"
    assert r["num_parameters"] == 4_852_224  # sum(p.numel()) of tiny_model("qwen3")
    assert r["state_bytes_per_token"] == 4 * 2 * 32 * 2 * 4
    assert r["param_bytes"] == 4 * 4_852_224 and r["optimizer_bytes"] == 8 * 4_852_224  # fp32: no master copy


def test_full_training_bytes():
    r = plan("llama-3.1-8b")
    n = 8_030_261_248
    assert (r["param_bytes"], r["grad_bytes"], r["optimizer_bytes"]) == (2 * n, 2 * n, 12 * n)


# ---------------------------------------------------------------------------- CLI


def test_cli_json_has_the_keys(capsys):
    code, out, _ = run_cli(capsys, "--model", "qwen3.6-27b", "--prompt-tokens", 2_097_152, "--group", 8,
                           "--response-tokens", 8192, "--gpus", 8, "--json")
    assert code == 0
    report = json.loads(out)  # exactly one JSON object
    assert isinstance(report, dict)
    for key in KEYS:
        assert key in report, key
    assert report["state_bytes_per_token"] == 65_536
    assert report["estimated_time_s_exact"] > report["estimated_time_s_detached"] > 0


def test_cli_table(capsys):
    code, out, _ = run_cli(capsys, "--model", "tiny-qwen3", "--prompt-tokens", 32768, "--group", 8,
                           "--response-tokens", 256, "--mode", "exact", "--throughput-tflops", 0.17)
    assert code == 0
    assert "PEAK per rank" in out and "state per prompt token" in out and "2,048 B" in out


def test_config_json_path(tmp_path, capsys):
    # a Qwen3.5-style checkpoint: the text model nested under "text_config"
    text = {**load_presets()["qwen3.6-27b"]["config"], "model_type": "qwen3_5_text"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_5", "text_config": text, "vision_config": {}}))
    code, out, _ = run_cli(capsys, "--model", path, "--prompt-tokens", 1000, "--group", 2, "--response-tokens", 10,
                           "--json")
    assert code == 0 and json.loads(out)["state_bytes_per_token"] == 65_536
    # a directory holding config.json works too, and a plain llama config without head_dim
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "torch_dtype": "float32"}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(llama))
    r = estimate(str(tmp_path / "llama"), PlanConfig(prompt_tokens=100, group=2, response_tokens=4))
    assert r["state_bytes_per_token"] == 2 * 2 * 16 * 2 * 4


def test_sliding_window_state_is_constant():
    cfg = {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "sliding_window": 16}
    a, b = (estimate(cfg, PlanConfig(prompt_tokens=p, group=2, response_tokens=4, dtype="fp32")) for p in (1000, 9000))
    assert a["state_bytes_per_token"] == 0
    assert a["state_bytes_total"] == b["state_bytes_total"] == 2 * 15 * 2 * 2 * 16 * 4
    # exact mode keeps every position of a sliding-window layer (the reverse walk recomputes every chunk)
    e = estimate(cfg, PlanConfig(prompt_tokens=1000, group=2, response_tokens=4, dtype="fp32", mode="exact"))
    assert e["state_bytes_per_token"] == 2 * 2 * 16 * 2 * 4 and e["state_bytes_fixed"] == 0


def test_unknown_preset_is_a_clear_error(capsys):
    with pytest.raises(ConfigError, match="unknown model 'gpt-9'.*Presets:.*qwen3.6-27b"):
        plan("gpt-9")
    code, _, err = run_cli(capsys, "--model", "gpt-9", "--prompt-tokens", 10, "--group", 2, "--response-tokens", 2)
    assert code == 2 and "unknown model 'gpt-9'" in err and "glm-5.2" in err


def test_unknown_model_type_lists_supported(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "num_hidden_layers": 2}))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*supported: llama.*glm_moe_dsa"):
        plan(str(path))


def test_bad_inputs():
    with pytest.raises(ConfigError, match="prompt_tokens"):
        plan(prompt_tokens=0)
    with pytest.raises(ConfigError, match="dtype"):
        plan(dtype="bf17")
    with pytest.raises(ConfigError, match="lora_rank"):
        plan(weight_dtype="nf4")
    with pytest.raises(ConfigError, match="memory size"):
        plan(gpu_memory="lots")


def test_parse_bytes():
    assert parse_bytes("96GB") == 96 * 10**9
    assert parse_bytes("96GiB") == parse_bytes("96G") == 96 * GiB
    assert parse_bytes("1.5 MiB") == 1.5 * MiB and parse_bytes(123) == parse_bytes("123") == 123


# ---------------------------------------------------------------------------- directions


def test_peak_per_rank_decreases_with_gpus():
    peaks = [plan("qwen3.6-27b", prompt_tokens=2_097_152, gpus=w, divide_capture=False)["peak_bytes_per_rank"]
             for w in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    # a divided capture holds the rank's hidden-state shard and one layer's projections of it
    # (~P/W tokens): at W = 2 and 2M tokens that is more than a replicated capture's chunk
    divided = [plan("qwen3.6-27b", prompt_tokens=2_097_152, gpus=w) for w in (2, 4, 8)]
    assert divided[0]["peak_phase"] == "capture"
    assert divided[0]["peak_bytes_per_rank"] > peaks[1]
    assert [r["peak_bytes_per_rank"] for r in divided] == sorted((r["peak_bytes_per_rank"] for r in divided),
                                                                 reverse=True)
    # capture is divided (each prompt token on one rank); replay's token computation is replicated
    times = [plan("qwen3.6-27b", prompt_tokens=2_097_152, gpus=w)["estimated_time_s"] for w in (1, 8)]
    assert times[0] / 8 < times[1] < times[0] / 4
    one, eight = (plan("qwen3.6-27b", prompt_tokens=2_097_152, gpus=w) for w in (1, 8))
    assert eight["divided_capture"] and not one["divided_capture"]
    # FLOPs of one rank: 1/8 of the tokens, plus the GDN transitions' extra (Dk + Dv) / Dv
    assert one["flops_capture"] / 8 < eight["flops_capture"] < 1.1 * one["flops_capture"] / 8
    replicated = plan("qwen3.6-27b", prompt_tokens=2_097_152, gpus=8, divide_capture=False)
    assert not replicated["divided_capture"] and replicated["capture_comm_bytes_per_rank"] == 0
    token = 2 * one["num_active_parameters"] * 2_097_152  # the token computation of the whole prompt
    assert replicated["flops_capture"] - eight["flops_capture"] == pytest.approx(7 / 8 * token, rel=0.15)


def test_divided_capture_traffic_and_fallbacks():
    """Bytes received in a divided capture: per attention layer the other ranks' K/V rows,
    per GDN layer one relayed state per block (rank 0 skips block 0), the conv tails and the
    snapshots; per MLA layer the other ranks' latent rows, and per DSA indexer layer their
    indexer keys; prompts with fewer blocks than ranks are not divided."""
    from longstraw.plan.arch import architecture, load_model_config
    from longstraw.plan.traffic import divided_capture_traffic

    arch = architecture(load_model_config("tiny-qwen3")[1])
    got = divided_capture_traffic("tiny-qwen3", positions=4000, world=2, block=1000, chunk_size=4096,
                                  dtype="float32")
    assert got == len(arch.layers) * 2000 * arch.kv_heads * 2 * arch.head_dim * 4  # every rank gets 2000 rows
    assert divided_capture_traffic("tiny-qwen3", positions=4000, world=1, block=1000, chunk_size=64) == 0
    r = plan("qwen3.6-27b", gpus=4)
    assert r["divided_capture"] and r["capture_comm_bytes_per_rank"] > 0
    assert r["capture_comm_bytes_per_rank"] < plan("qwen3.6-27b", gpus=4, mode="exact",
                                                   chunk_size=512)["capture_comm_bytes_per_rank"]  # snapshots
    glm = architecture(load_model_config("glm-5.2")[1])
    rows = glm.count(mixer="mla") * (glm.kv_lora_rank + glm.rope_dim) + glm.count(indexer=True) * glm.index_dim
    assert 0 < glm.count(indexer=True) < glm.count(mixer="mla")  # GLM-5's "shared" layers fetch no indexer keys
    got = divided_capture_traffic("glm-5.2", positions=400_000, world=4, block=1000, chunk_size=4096,
                                  dtype="bfloat16")
    assert got == 300_000 * rows * 2  # every rank gets the other 3/4 of the rows
    assert plan("glm-5.2", gpus=4)["divided_capture"] and plan("glm-5.2", gpus=4)["capture_comm_bytes_per_rank"] > 0
    assert not plan("qwen3.6-27b", gpus=4, prompt_tokens=2048, attention_block_size=1024)["divided_capture"]


def test_divided_walk_and_its_fallbacks():
    """Exact mode on a dense model under CP: the reverse walk's token computation is divided
    (each prompt token on one rank; each walk chunk's self part on every rank), in whole
    cycles of the deal, also with sharded weights (FSDP2); kept graphs, an offloaded state,
    `divide_walk=False` and detached mode walk replicated (or not at all); a GDN hybrid's
    walk is divided too, in whole capture chunks, its recurrence replicated; so is GLM-5's
    (MLA + DSA)."""
    from longstraw.parallel.deal import walk_chunk_tokens

    kw = dict(prompt_tokens=1_048_576, gpus=8, mode="exact", chunk_size=4096, attention_block_size=1024,
              recompute_layers=False)  # the walk without layer recompute: (1 + backward) per chunk
    divided, replicated = plan("qwen3-8b", **kw), plan("qwen3-8b", divide_walk=False, **kw)
    assert divided["divided_walk"] and not replicated["divided_walk"]
    assert divided["walk_chunk_tokens"] == walk_chunk_tokens(1_048_575, 4096, 8, 1024) == 8192
    token = 2 * divided["num_active_parameters"] * 1_048_576  # the token computation of the whole prompt
    saved = replicated["flops_exact_extra"] - divided["flops_exact_extra"]
    assert 0.6 * 7 / 8 * token * 3 < saved < 7 / 8 * token * 3  # (1 + backward) x 7/8 of it, less the self parts
    assert divided["recompute_working_bytes"] < replicated["recompute_working_bytes"]
    assert divided["estimated_time_s_exact"] < replicated["estimated_time_s_exact"]
    hybrid = plan("qwen3.6-27b", **{**kw, "chunk_size": 3000})
    assert hybrid["divided_walk"] and hybrid["walk_chunk_tokens"] == 9000  # 3 capture chunks hold a cycle
    assert hybrid["flops_exact_extra"] < plan("qwen3.6-27b", divide_walk=False,
                                              **{**kw, "chunk_size": 3000})["flops_exact_extra"]
    glm = plan("glm-5.2", **kw)
    glm_replicated = plan("glm-5.2", divide_walk=False, **kw)
    assert glm["divided_walk"] and glm["walk_chunk_tokens"] == 8192
    token = 2 * glm["num_active_parameters"] * 1_048_576
    saved = glm_replicated["flops_exact_extra"] - glm["flops_exact_extra"]
    assert 0.6 * 7 / 8 * token * 3 < saved < 7 / 8 * token * 3
    assert glm["recompute_working_bytes"] < glm_replicated["recompute_working_bytes"]
    for other in (plan("qwen3-8b", **{**kw, "gpus": 1}),
                  plan("qwen3-8b", keep_graph_bytes=1 << 40, **kw), plan("qwen3-8b", offload_state=True, **kw),
                  plan("qwen3-8b", **{**kw, "mode": "detached"})):
        assert not other["divided_walk"]
    assert plan("qwen3-8b", shard_params=True, **kw)["divided_walk"]


def test_own_self_pairs_is_the_fullest_ranks_share_of_a_chunks_causal_pairs():
    """A divided walk attends each chunk's self part for a rank's own query rows only: with
    one cycle per chunk the last rank is fullest (its block sees the 7 before it); with
    more cycles the deal evens out toward 1/W."""
    from longstraw.plan.timing import own_self_pairs

    assert own_self_pairs(8192, 8, 1024) == 7 * 1024 * 1024 + 1024 * 1025 / 2
    assert own_self_pairs(10, 1, 4) == 10 * 11 / 2  # one rank: the whole causal square
    whole = 65536 * 65537 / 2
    assert 1 / 8 < own_self_pairs(65536, 8, 1024) / whole < 1.15 / 8  # 8 cycles: 1.11 / 8


def test_exact_mode_keeps_every_gdn_snapshot_on_every_rank():
    """Qwen3.6-27B at 2M tokens, chunk 4096: 512 snapshots x 144 MiB on EVERY rank (the
    recurrent state is replicated, every rank walks every chunk), not 1/W of them."""
    r1, r8 = (plan("qwen3.6-27b", prompt_tokens=2_097_152, gpus=w, mode="exact", chunk_size=4096) for w in (1, 8))
    snapshot = r1["state_bytes_fixed"]
    assert r8["exact_checkpoint_bytes_per_rank"] == r1["exact_checkpoint_bytes_per_rank"] == 511 * snapshot
    assert r8["exact_checkpoint_bytes_per_rank"] > 70 * GiB


def test_fits_flips_with_gpu_memory(capsys):
    r = plan("llama-3.1-8b", lora_rank=16, gpus=4)
    need = r["peak_bytes_per_rank"] + r["reserve_bytes"]
    assert plan("llama-3.1-8b", lora_rank=16, gpus=4, gpu_memory=need)["fits"]
    assert not plan("llama-3.1-8b", lora_rank=16, gpus=4, gpu_memory=need - 1)["fits"]
    args = ["--model", "llama-3.1-8b", "--prompt-tokens", 131072, "--group", 8, "--response-tokens", 1024,
            "--lora-rank", 16, "--json"]
    assert json.loads(run_cli(capsys, *args, "--gpu-memory", "80GB")[1])["fits"]
    assert not json.loads(run_cli(capsys, *args, "--gpu-memory", "16GB")[1])["fits"]


def test_peak_does_not_grow_with_group():
    a, b = plan(group=2), plan(group=64)
    assert a["peak_bytes_per_rank"] == b["peak_bytes_per_rank"]
    assert b["estimated_time_s"] > a["estimated_time_s"]


def test_exact_mode_costs_more():
    d, e = plan("qwen3.6-27b", chunk_size=512), plan("qwen3.6-27b", chunk_size=512, mode="exact")
    # bf16 state, fp32 gradient buffers: twice the per-token state, plus one fp32 gradient per GDN snapshot
    per_token = 2 * d["state_bytes_per_token"] * 131072
    assert per_token < e["state_grad_bytes_per_rank"] < per_token + 2 * (131072 // 512) * d["state_bytes_fixed"]
    # one snapshot per chunk end; the last one is the state itself
    assert e["exact_checkpoint_bytes_per_rank"] == (131072 // 512 - 1) * d["state_bytes_fixed"]
    assert e["peak_bytes_per_rank"] > d["peak_bytes_per_rank"]
    extra = 3 * e["breakdown"]["time_s"]["capture"]  # recompute x1 + backward x2 of the prompt forward
    assert e["estimated_time_s_exact"] == pytest.approx(e["estimated_time_s_detached"] + extra)


def test_lora_and_quantization_shrink_static_memory():
    full = plan("qwen3.6-27b")
    lora = plan("qwen3.6-27b", lora_rank=16)
    qlora = plan("qwen3.6-27b", lora_rank=16, weight_dtype="nf4")
    assert full["static_bytes_per_rank"] > lora["static_bytes_per_rank"] > qlora["static_bytes_per_rank"]


def test_branch_pieces_shrink_replay():
    # recompute pinned off: the default turns it on for the one 8,192-token piece (its graph > 2x what is held)
    one = plan("qwen3.6-27b", response_tokens=8192, recompute_layers=False)
    pieces = plan("qwen3.6-27b", response_tokens=8192, branch_chunk_size=2048, recompute_layers=False)
    assert pieces["replay_working_bytes"] < one["replay_working_bytes"] / 2
    assert pieces["breakdown"]["replay"]["held_branch_tokens"] == 6144


def test_shard_params():
    base = plan("glm-5.2", prompt_tokens=2_097_152, gpus=32, lora_rank=8)
    sharded = plan("glm-5.2", prompt_tokens=2_097_152, gpus=32, lora_rank=8, shard_params=True)
    cfg = load_presets()["glm-5.2"]["config"]
    whole = (2 * cfg["vocab_size"] * cfg["hidden_size"] + cfg["hidden_size"]) * 2  # embeddings, lm_head, norm (bf16)
    # FSDP2 wraps the decoder layers only: the rest stays whole on every rank (issue 43 item 3)
    assert sharded["param_bytes"] == pytest.approx(whole + (base["param_bytes"] - whole) / 32, rel=1e-6)
    assert sharded["state_bytes_on_gpu_per_rank"] == base["state_bytes_on_gpu_per_rank"] == 5.8125 * GiB


def test_state_offload_keeps_two_layers_on_the_device_and_counts_the_traffic():
    """GLM-5.2 as the paper ran it (32 ranks, LoRA): 5.8125 GiB of state per rank moves to
    host; the device keeps two of its 78 layers' rows. Qwen3.6-27B at 2M positions on one
    141 GB GPU fits only with offload (LoRA, branch pieces of 1024)."""
    base = plan("glm-5.2", prompt_tokens=2_097_152, gpus=32, lora_rank=8)
    off = plan("glm-5.2", prompt_tokens=2_097_152, gpus=32, lora_rank=8, offload_state=True)
    assert off["offload_host_bytes_per_rank"] == pytest.approx(5.8125 * GiB, rel=1e-4)  # P - 1 rows, not P
    assert off["offload_slot_bytes_per_rank"] < off["offload_host_bytes_per_rank"] * 2.5 / 78  # two of 78 layers
    assert off["peak_bytes_per_rank"] < base["peak_bytes_per_rank"] - 5 * GiB
    assert off["offload_traffic_bytes_per_step"] > 0 and off["offload_transfer_time_s"] == pytest.approx(
        off["offload_traffic_bytes_per_step"] / 50e9)
    assert base["offload_traffic_bytes_per_step"] == 0 and base["offload_host_bytes_per_rank"] == 0

    kw = dict(prompt_tokens=2_097_152, gpus=1, group=8, response_tokens=8192, branch_chunk_size=1024, lora_rank=16,
              chunk_size=8192, gpu_memory="141GB")
    on_device, offloaded = plan("qwen3.6-27b", **kw), plan("qwen3.6-27b", offload_state=True, **kw)
    assert not on_device["fits"] and offloaded["fits"]
    assert offloaded["offload_host_bytes_per_rank"] == 16 * 8 * GiB - 16 * 4096  # 16 layers x 8 GiB, P - 1 rows
    assert offloaded["offload_slot_bytes_per_rank"] == 2 * (8 * GiB - 4096)
    # traffic: capture reads each chunk's prefix of every layer; each piece stages every layer twice
    o, rows = offloaded["offload"], 2_097_151
    prefix = sum(range(0, rows, 8192))
    assert o["h2d_bytes"]["capture"] == 16 * 4096 * prefix
    assert o["h2d_bytes"]["replay"] == 8 * (7 + 8 + 8) * 16 * 4096 * rows
    twice = plan("qwen3.6-27b", offload_state=True, host_bandwidth_gbs=100.0, **kw)
    assert twice["offload_transfer_time_s"] == pytest.approx(offloaded["offload_transfer_time_s"] / 2)


def test_state_offload_on_the_command_line(capsys):
    code, out, _ = run_cli(capsys, "--model", "qwen3.6-27b", "--prompt-tokens", 2097152, "--gpus", 1,
                           "--group", 8, "--response-tokens", 8192, "--branch-chunk-size", 1024, "--lora-rank", 16,
                           "--chunk-size", 8192, "--gpu-memory", "141GB", "--offload-state", "--host-bandwidth", 25)
    assert code == 0 and "offload: host memory per rank" in out and "at 25 GB/s" in out
    assert [line.split()[1] for line in out.splitlines() if line.split()[:1] == ["fits"]] == ["yes"]
    with pytest.raises(ConfigError, match="keep_graph_bytes"):
        plan("qwen3.6-27b", mode="exact", offload_state=True, keep_graph_bytes="1GiB")
    with pytest.raises(ConfigError, match="host_bandwidth_gbs"):
        plan("qwen3.6-27b", offload_state=True, host_bandwidth_gbs=0)


def test_score_passes_add_time_not_replay_memory():
    # without layer-wise recompute, whose extra forward is not scaled by score passes (below)
    a, b = plan("qwen3.6-27b", recompute_layers=False), plan("qwen3.6-27b", score_passes=2, recompute_layers=False)
    assert b["flops_replay_per_branch"] == pytest.approx(a["flops_replay_per_branch"] * 5 / 3)
    assert b["replay_working_bytes"] == a["replay_working_bytes"] and b["score_working_bytes"] > 0


# ---------------------------------------------------------------------------- working-set model


def test_kernel_constants_mirror_the_ops():
    """The planner's working sets assume the kernels' default block sizes."""
    import inspect

    from longstraw.ops import dsa, gated_delta
    from longstraw.plan import arch

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default

    assert default(dsa.indexer_topk, "query_block") == arch.INDEXER_QUERY_BLOCK
    assert default(dsa.indexer_topk, "key_block") == arch.INDEXER_KEY_BLOCK
    assert default(dsa.sparse_latent_attention, "query_block") == arch.SPARSE_QUERY_BLOCK
    assert default(gated_delta.chunk_gated_delta_rule, "chunk_size") == arch.GDN_CHUNK


def test_first_group_capture_has_no_gradients():
    later, first = plan("qwen3.6-27b", prompt_tokens=1 << 20), plan("qwen3.6-27b", prompt_tokens=1 << 20,
                                                                      grads_during_capture=False)
    phases_later, phases_first = later["breakdown"]["phase_peak_bytes"], first["breakdown"]["phase_peak_bytes"]
    assert phases_later["capture"] - phases_first["capture"] == later["grad_bytes"] > 0
    assert phases_later["replay"] == phases_first["replay"]
    assert first["peak_bytes_per_rank"] <= later["peak_bytes_per_rank"]
    assert later["peak_bytes_per_rank"] == max(phases_later.values())


def test_fla_kernel_needs_less_than_the_torch_path():
    # the whole piece's graph (with recompute the full-attention layers set replay's moment, whatever the kernel)
    torch_path = plan("qwen3.6-27b", prompt_tokens=1 << 20, gdn_kernel="torch", recompute_layers=False)
    fla = plan("qwen3.6-27b", prompt_tokens=1 << 20, gdn_kernel="fla", recompute_layers=False)
    assert fla["capture_working_bytes"] < torch_path["capture_working_bytes"]
    # the torch kernel is a registered op: its graph keeps only its inputs, its backward recomputes the rest
    graph = {k: r["breakdown"]["replay"]["graph_bytes_per_token"] for k, r in (("torch", torch_path), ("fla", fla))}
    assert graph["torch"] < graph["fla"]
    assert fla["state_bytes_total"] == torch_path["state_bytes_total"]
    with pytest.raises(ConfigError, match="gdn_kernel"):
        plan(gdn_kernel="triton")


def test_dsa_selection_grows_with_the_prompt():
    """The indexer scores a [128, P] block per query block: capture working grows with P."""
    small, big = plan("glm-5.2", prompt_tokens=1 << 16), plan("glm-5.2", prompt_tokens=1 << 21)
    grown = big["capture_working_bytes"] - small["capture_working_bytes"]
    assert grown >= 14 * 128 * ((1 << 21) - (1 << 16))


def test_cli_first_group_and_gdn_kernel(capsys):
    code, out, _ = run_cli(capsys, "--model", "qwen3.6-27b", "--prompt-tokens", 65536, "--group", 2,
                           "--response-tokens", 512, "--first-group", "--gdn-kernel", "fla", "--json")
    r = json.loads(out)
    assert code == 0 and r["inputs"]["grads_during_capture"] is False and r["inputs"]["gdn_kernel"] == "fla"


def test_activation_model_is_calibrated_on_hf_saved_tensors():
    """docs/planner.md: on tiny-qwen3 the planner's graph per token per layer (5,376 fp32
    elements) is within 0.3% of what HF's own forward saves per layer (5,388: the slope of the
    saved bytes per token between a 1- and a 2-layer model)."""
    import torch

    from longstraw.measure import naive_bytes_per_token
    from longstraw.plan.arch import architecture
    from longstraw.plan.working import graph_bytes_per_token
    from longstraw.tiny import tiny_model

    per_model = {}
    for n in (1, 2):
        model = tiny_model("qwen3", dtype=torch.float32, num_hidden_layers=n)
        per_model[n] = naive_bytes_per_token(model, model.config.vocab_size)
    hf_elements = (per_model[2] - per_model[1]) / 4
    arch = architecture(model.config.to_dict())
    planned = graph_bytes_per_token(arch, arch.layers[0], 4, "torch") / 4
    assert (planned, hf_elements) == (5376, 5388)
    assert abs(planned / hf_elements - 1) < 0.003


# ---------------------------------------------------------------------------- one source of truth, no torch

TIED_DEFAULTS = {"mode": "MODE", "chunk_size": "CHUNK_SIZE", "branch_chunk_size": "BRANCH_CHUNK_SIZE",
                 "attention_block_size": "ATTENTION_BLOCK_SIZE", "logits_chunk_size": "LOGITS_CHUNK_SIZE",
                 "divide_capture": "DIVIDE_CAPTURE", "divide_walk": "DIVIDE_WALK",
                 "keep_graph_bytes": "KEEP_GRAPH_BYTES", "recompute_layers": "RECOMPUTE_LAYERS",
                 "keep_attention_outputs": "KEEP_ATTENTION_OUTPUTS",
                 "offload_snapshots": "OFFLOAD_SNAPSHOTS"}


def test_plan_and_exec_configs_share_their_defaults():
    import dataclasses

    from longstraw import defaults
    from longstraw.config import ExecConfig

    plan_fields = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    exec_fields = {f.name: f.default for f in dataclasses.fields(ExecConfig)}
    for field, constant in TIED_DEFAULTS.items():
        assert plan_fields[field] == exec_fields[field] == getattr(defaults, constant), field


def _python(code: str, cwd, pythonpath: str):
    """Run `code` in a fresh interpreter with torch blocked (sys.modules['torch'] = None)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": pythonpath}
    prelude = "import sys; sys.modules['torch'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


PLAN_WITHOUT_TORCH = """
import longstraw, longstraw.plan
from longstraw.plan import PlanConfig, estimate, format_report, load_presets
for name in sorted(load_presets()):
    for mode in ("detached", "exact"):
        r = estimate(name, PlanConfig(prompt_tokens=65536, group=4, response_tokens=512, mode=mode, gpus=4))
        assert r["peak_bytes_per_rank"] > 0 and "PEAK per rank" in format_report(r)
from longstraw.parallel.deal import walk_chunk_bounds
assert walk_chunk_bounds(8192, 4096, 2, 1024)[0] == (0, 4096)
assert "torch" not in sys.modules or sys.modules["torch"] is None
print("ok")
"""


def test_planner_runs_without_torch():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    done = _python(PLAN_WITHOUT_TORCH, root, str(root))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    # and the engine's API is still there, lazily: naming it imports torch (blocked here)
    done = _python("import longstraw as ls\nls.ExecConfig", root, str(root))
    assert done.returncode != 0 and "torch" in done.stderr


def test_presets_ship_inside_the_package(tmp_path):
    """What a wheel installs (the package's .py files and its declared package-data, nothing
    else) plans every preset, and presets.json names no file outside the package."""
    import pathlib
    import re
    import shutil
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["longstraw"]
    site = tmp_path / "site"
    for path in [*(root / "longstraw").rglob("*.py"), *(p for g in data for p in (root / "longstraw").glob(g))]:
        target = site / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    done = _python(PLAN_WITHOUT_TORCH, tmp_path, str(site))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    text = (root / "longstraw" / "plan" / "presets.json").read_text()
    assert not re.search(r"\.\./|\.md\b|shared/", text), "presets.json points at a file outside the package"


@pytest.mark.parametrize("name,per_token,fixed,counts", [
    # full layers x 2 (K, V) x kv_heads x head_dim x 2 bytes (bf16); a sliding layer holds W - 1 positions
    ("gpt-oss-120b", 18 * 2 * 8 * 64 * 2, 18 * 127 * 2 * 8 * 64 * 2,
     {"full_attention": 18, "sliding_attention": 18, "moe": 36}),
    ("qwen3-235b-a22b", 94 * 2 * 4 * 128 * 2, 0, {"full_attention": 94, "moe": 94}),
    ("qwen3-30b-a3b", 48 * 2 * 4 * 128 * 2, 0, {"full_attention": 48, "moe": 48}),
    ("glm-4.6", 92 * 2 * 8 * 128 * 2, 0, {"full_attention": 92, "moe": 89}),       # 3 dense layers first
    ("gemma-3-27b", 10 * 2 * 16 * 128 * 2, 52 * 1023 * 2 * 16 * 128 * 2,       # layers 6, 12, .., 60 global
     {"full_attention": 10, "sliding_attention": 52}),
    ("minimax-m2", 62 * 2 * 8 * 128 * 2, 0, {"full_attention": 62, "moe": 62}),
])
def test_family_presets_state_bytes_by_hand(name, per_token, fixed, counts):
    """The part-1 family presets at P = 1,048,576 (bf16): state bytes per token and the
    constant sliding-window part, written out from each config; parameter counts within
    2% of the published totals (GLM-4.6's MTP layer is not modelled)."""
    r = plan(name, prompt_tokens=1_048_576, dtype="bf16")
    assert r["state_bytes_per_token"] == per_token and r["state_bytes_fixed"] == fixed
    assert r["layer_counts"] == counts
    published = load_presets()[name]["num_parameters"]
    assert abs(r["num_parameters"] - published) <= 0.02 * published, (r["num_parameters"], published)


def test_layer_wise_recompute_shrinks_replay_for_one_more_forward(capsys):
    from longstraw.plan.config import resolve
    from longstraw.plan.timing import forward_flops

    kw = dict(prompt_tokens=2088960, group=8, response_tokens=8192, gpus=8, branch_chunk_size=2048, lora_rank=16,
              weight_dtype="nf4")
    off, on, auto = (plan("qwen3.6-27b", recompute_layers=v, **kw) for v in (False, True, None))
    assert not off["replay_recompute_layers"] and on["replay_recompute_layers"]
    # since the torch GDN kernel is a registered op whose graph keeps only its inputs (ops/registered.py),
    # a piece's graph (42.9 GiB) is under twice what the step holds: auto does not recompute, and both fit
    assert {k: v for k, v in auto.items() if k != "inputs"} == {k: v for k, v in off.items() if k != "inputs"}
    assert on["replay_working_bytes"] < off["replay_working_bytes"] / 5
    assert off["fits"] and on["fits"] and on["peak_bytes_per_rank"] <= 0.85 * 96 * 2**30
    s = resolve("qwen3.6-27b", PlanConfig(**kw))
    extra = forward_flops(s.arch, s.params, 8192, 2088960, lm_head=False, world=8)
    assert on["flops_replay_per_branch"] - off["flops_replay_per_branch"] == pytest.approx(extra)
    assert not plan("qwen3.6-27b", **dict(kw, branch_chunk_size=512))["replay_recompute_layers"]  # short pieces
    code, out, _ = run_cli(capsys, "--model", "qwen3.6-27b", "--prompt-tokens", 4096, "--group", 2,
                           "--response-tokens", 2048, "--recompute-layers", "off",
                           "--json")
    assert code == 0 and json.loads(out)["replay_recompute_layers"] is False
    with pytest.raises(ConfigError, match="recompute_layers"):
        plan("qwen3.6-27b", recompute_layers="yes")


# ---------------------------------------------------------------------------- prefix trees (plan/tree.py)

from longstraw.plan.arch import BACKWARD_FACTOR  # noqa: E402
from longstraw.plan.timing import forward_flops  # noqa: E402


@pytest.mark.parametrize("model,kw", [("qwen3-8b", {}), ("qwen3-8b", {"mode": "exact", "branch_chunk_size": 300}),
                                      ("qwen3.6-27b", {"score_passes": 2, "gpus": 2}),
                                      ("glm-5.2", {"mode": "exact", "offload_state": True})])
def test_a_flat_tree_is_todays_plan(model, kw):
    """tree=[(R, G)] is the flat group: every figure of the report equals group=G, response_tokens=R."""
    flat = plan(model, group=8, response_tokens=1000, **kw)
    tree = plan(model, group=1, response_tokens=1, tree=[(1000, 8)], **kw)
    assert tree["tree"]["replay_tokens"] == tree["tree"]["flat_tokens"] == 8000
    for key in set(flat) - {"inputs"}:
        assert tree[key] == flat[key], key


def test_a_tree_replays_each_segment_once_by_hand():
    """Three levels 2 x 4 x 2 of 1,024 / 512 / 128 tokens after P: replay tokens 2*1024 + 8*512 + 16*128;
    time = capture + the two internal levels' (capture forward + forward + backward) per node + 16 leaf
    branches of 128 tokens after P + 1,536 positions."""
    P, kw = 16384, dict(prompt_tokens=16384, dtype="fp32", throughput_tflops=1.0, recompute_layers=False)
    r = estimate("tiny-qwen3", PlanConfig(tree="1024x2,512x4,128x2", **kw))
    flat = estimate("tiny-qwen3", PlanConfig(group=16, response_tokens=1664, **kw))
    assert r["inputs"]["group"] == 16 and r["inputs"]["response_tokens"] == 1664
    assert r["tree"]["replay_tokens"] == 2 * 1024 + 8 * 512 + 16 * 128 == 8192 and r["tree"]["flat_tokens"] == 26624
    from longstraw.plan.config import resolve
    s = resolve("tiny-qwen3", PlanConfig(tree="1024x2,512x4,128x2", **kw))

    def fwd(n, prefix, lm):
        return forward_flops(s.arch, s.params, n, prefix, lm_head=lm, world=1)

    def internal(n, prefix):
        return fwd(n, prefix, False) + (1 + BACKWARD_FACTOR) * fwd(n, prefix, True)

    tree_flops = (2 * internal(1024, P) + 8 * internal(512, P + 1024)
                  + 16 * (1 + BACKWARD_FACTOR) * fwd(128, P + 1536, True))
    assert r["tree"]["flops_replay_tree"] == pytest.approx(tree_flops, rel=1e-12)
    assert r["estimated_time_s_detached"] == pytest.approx((r["flops_capture"] + tree_flops) / 1e12, rel=1e-12)
    assert r["estimated_time_s_detached"] < flat["estimated_time_s_detached"]
    # layer-wise recompute (as the engine's tree walk applies it): one more forward of every segment's layers
    on = estimate("tiny-qwen3", PlanConfig(tree="1024x2,512x4,128x2", **dict(kw, recompute_layers=True)))
    more = 2 * fwd(1024, P, False) + 8 * fwd(512, P + 1024, False) + 16 * fwd(128, P + 1536, False)
    assert on["tree"]["flops_replay_tree"] - tree_flops == pytest.approx(more, rel=1e-9)


def test_a_trees_memory_is_the_path_not_the_leaves():
    """The replay working set is the prompt state + the path's segment states (with gradient buffers) + one
    piece's graph: G = 8 or 64 leaves under one 2,048-token segment need the same; the held state is that
    segment's rows, twice (state + gradient; dense: no recurrent snapshots)."""
    kw = dict(prompt_tokens=16384, dtype="fp32")
    a, b = (estimate("tiny-qwen3", PlanConfig(tree=[(2048, 1), (256, g)], **kw)) for g in (8, 64))
    assert a["replay_working_bytes"] == b["replay_working_bytes"] and a["peak_bytes_per_rank"] == b["peak_bytes_per_rank"]
    assert a["breakdown"]["replay"]["branch_state_bytes"] == 2 * a["state_bytes_per_token"] * 2048
    flat = estimate("tiny-qwen3", PlanConfig(group=8, response_tokens=2304, **kw))
    assert a["replay_working_bytes"] < flat["replay_working_bytes"]  # a 2,048-token walk chunk < a 2,304 branch


def test_tree_levels_of_fan_out_one_merge_and_bad_trees_are_clear_errors(capsys):
    r = plan(tree=[(100, 2), (50, 1), (30, 3)])
    assert r["tree"]["merged_levels"] == [[150, 2], [30, 6]] and r["inputs"]["group"] == 6
    for bad in ([], [(0, 2)], [(2, 2, 2)], [(True, 2)], "2048y1", "12x", 5):
        with pytest.raises(ConfigError, match="tree"):
            plan(tree=bad)
    code, out, _ = run_cli(capsys, "--model", "qwen3-8b", "--prompt-tokens", 4096, "--tree", "2048x1,256x8", "--json")
    assert code == 0 and json.loads(out)["tree"]["levels"] == [[2048, 1], [256, 8]]


# ---------------------------------------------------------------------------- exact mode at the paper's scale


def test_state_gradients_are_allocated_after_capture():
    """Exact mode allocates dLoss/dState after capture (before it only to keep chunk
    graphs): a dense model's capture phase peaks where detached mode's does."""
    kw = dict(prompt_tokens=131072, chunk_size=4096)
    d, e = plan("qwen3-8b", **kw), plan("qwen3-8b", mode="exact", **kw)
    assert e["breakdown"]["phase_peak_bytes"]["capture"] == d["breakdown"]["phase_peak_bytes"]["capture"]
    kept = plan("qwen3-8b", mode="exact", keep_graph_bytes="1GiB", **kw)
    assert kept["breakdown"]["phase_peak_bytes"]["capture"] > e["breakdown"]["phase_peak_bytes"]["capture"] \
        + kept["state_grad_bytes_per_rank"] - 1


PAPER_QWEN = dict(prompt_tokens=2088960, group=8, response_tokens=8192, gpus=8, lora_rank=16, weight_dtype="nf4",
                  mode="exact")


def test_the_walk_recomputes_layers_and_keeps_snapshots_on_host():
    """The paper's Qwen3.6-27B run in exact mode: layer-wise recompute takes the divided
    walk's working set from ~49 GiB to ~3 (rehearsed without recompute at P = 65,536:
    planned / rehearsed walk 1.001; the GDN layers' replicated part keeps only the conv's
    rows and the kernel's inputs), and the GDN snapshots (~73 GiB on
    every rank) move to host memory with offload_snapshots; only one staged pair and two
    gradients per layer stay."""
    off = plan("qwen3.6-27b", branch_chunk_size=2048, recompute_layers=False, **PAPER_QWEN)
    # recompute asked for: by default the walk's chunk graph is under 2x what the step holds
    on = plan("qwen3.6-27b", branch_chunk_size=2048, recompute_layers=True, **PAPER_QWEN)
    host = plan("qwen3.6-27b", branch_chunk_size=2048, offload_snapshots=True, recompute_layers=True, **PAPER_QWEN)
    assert not plan("qwen3.6-27b", branch_chunk_size=2048, **PAPER_QWEN)["walk_recompute_layers"]
    assert on["walk_recompute_layers"] and not off["walk_recompute_layers"]
    assert on["recompute_working_bytes"] < off["recompute_working_bytes"] / 10
    assert on["flops_exact_extra"] > off["flops_exact_extra"]  # one more forward per walk chunk
    assert on["exact_checkpoint_bytes_per_rank"] > 70 * GiB and not on["exact_snapshots"]["offload"]
    snaps = host["exact_snapshots"]
    assert host["exact_checkpoint_bytes_per_rank"] == snaps["device_bytes"] == on["state_bytes_fixed"]
    assert snaps["host_bytes"] == on["exact_checkpoint_bytes_per_rank"] == snaps["d2h_bytes"]
    assert host["state_grad_bytes_per_rank"] < on["state_bytes_per_token"] * 261120 * 2 + 3 * on["state_bytes_fixed"]


@pytest.mark.parametrize("pieces", [2048, 8192])
def test_the_papers_qwen_exact_run_fits(pieces):
    r = plan("qwen3.6-27b", branch_chunk_size=pieces, offload_snapshots=True, recompute_layers=True, **PAPER_QWEN)
    assert r["fits"] and r["peak_bytes_per_rank"] <= 0.85 * r["gpu_memory_bytes"], r["peak_bytes_per_rank"] / GiB
    one = plan("qwen3.6-27b", **dict(PAPER_QWEN, prompt_tokens=2097152, gpus=1, weight_dtype=None),
               gpu_memory="141GB", offload_state=True, branch_chunk_size=2048, recompute_layers=True)
    assert one["exact_snapshots"]["offload"] and one["peak_bytes_per_rank"] <= 0.85 * one["gpu_memory_bytes"]


def test_the_walk_recomputes_layers_under_fsdp2_as_the_engine_does():
    """The engine's walk recomputes layers under FSDP2 when asked (issue 43 item 6a,
    tests/parallel/test_sharding.py), and keeps no capture graph there: the plan follows."""
    kw = dict(PAPER_QWEN, branch_chunk_size=2048, recompute_layers=True)
    assert plan("qwen3.6-27b", **kw)["walk_recompute_layers"]
    assert plan("qwen3.6-27b", shard_params=True, **kw)["walk_recompute_layers"]  # the engine's rule


def test_kept_attention_outputs_hold_their_bytes_and_skip_the_walks_attention_forward():
    """keep_attention_outputs: the static memory grows by H (Dv b + acc) per recomputed
    position and full-attention layer; the walk's FLOPs lose exactly the recomputed
    forward's QK^T / PV over the prompt (one forward of them per recomputed chunk); with
    every chunk's graph kept nothing is recomputed, so nothing is kept."""
    from longstraw.plan.config import resolve
    from longstraw.plan.timing import mixer_flops

    P, kw = 8192, dict(prompt_tokens=8192, group=8, response_tokens=128, mode="exact", dtype="float32",
                       chunk_size=1024, recompute_layers=False, throughput_tflops=1.0)
    off = estimate("tiny-qwen3", PlanConfig(**kw))
    on = estimate("tiny-qwen3", PlanConfig(keep_attention_outputs=True, **kw))
    s = resolve("tiny-qwen3", PlanConfig(**kw))
    layers, heads, d = s.arch.count(mixer="attention", window=None), s.arch.heads, s.arch.head_dim
    assert layers == len(s.arch.layers) and on["kept_attention_bytes_per_rank"] == layers * (P - 1) * heads * (4 * d + 4)
    assert off["kept_attention_bytes_per_rank"] == 0
    assert on["static_bytes_per_rank"] - off["static_bytes_per_rank"] == on["kept_attention_bytes_per_rank"]
    attention = sum(mixer_flops(s.arch, layer, P, 0) for layer in s.arch.layers)
    saved = off["estimated_time_s_compute"] - on["estimated_time_s_compute"]
    assert saved == pytest.approx(attention / 1e12, rel=1e-9) and saved > 0
    kept = estimate("tiny-qwen3", PlanConfig(keep_attention_outputs=True, keep_graph_bytes=1 << 40, **kw))
    assert kept["kept_attention_bytes_per_rank"] == 0
    with pytest.raises(ConfigError, match="keep_attention_outputs"):
        PlanConfig(keep_attention_outputs=True, offload_state=True, **kw)


def test_kept_attention_outputs_of_mla_count_the_latent_and_only_dense_layers():
    """MLA keeps [H, kv_lora_rank] outputs over the latent, per layer whose queries select
    every position they see: DeepSeek-V3.2's DSA at P below its top-k keeps every layer's,
    above it none (its sparse attention is computed again)."""
    from longstraw.plan.config import resolve

    kw = dict(prompt_tokens=1024, group=2, response_tokens=64, mode="exact", keep_attention_outputs=True)
    a = resolve("deepseek-v3.2", PlanConfig(**kw)).arch
    assert a.index_topk > 1024 and all(layer.mixer == "mla" for layer in a.layers)
    r = estimate("deepseek-v3.2", PlanConfig(**kw))
    assert r["kept_attention_bytes_per_rank"] == len(a.layers) * 1023 * a.heads * (a.kv_lora_rank * 2 + 4)
    long = estimate("deepseek-v3.2", PlanConfig(**{**kw, "prompt_tokens": 4 * a.index_topk}))
    assert long["kept_attention_bytes_per_rank"] == 0
