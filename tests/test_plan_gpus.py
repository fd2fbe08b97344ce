"""GPU presets (`plan/gpus.py`, `plan/gpus.json`) and communication in the time
(`plan/comm.py`): every figure sourced, the preset fills only what is not given, the H20
efficiency is the calibration it claims, the paper's times are predicted from it, and
each phase's time follows the stated overlap rule by hand. Torch-free, fast."""

import dataclasses
import json

import pytest

from longstraw.cli import main
from longstraw.errors import ConfigError
from longstraw.plan import PlanConfig, estimate, parse_bytes
from longstraw.plan.config import _DEFAULTS
from longstraw.plan.calibrate import calibrate_h20
from longstraw.plan.gpus import (DEFAULT_EFFICIENCY, GPUS_PATH, LINK_EFFICIENCY, PAPER_CAPTURE_S, PAPER_RUN, gpu_spec,
                                 load_gpus)

FIGURES = ("memory", "bf16_tflops", "hbm_gbs", "intra_node_gbs", "inter_node_gbs", "host_gbs")


def test_every_preset_has_every_figure_with_a_source():
    gpus = load_gpus()
    assert set(gpus) == {"h20", "h100", "h200", "b200", "a100-80gb", "mi300x"}
    raw = json.load(open(GPUS_PATH))
    for name, spec in gpus.items():
        for figure in FIGURES:
            assert figure in raw[name] and raw[name]["_source"].get(figure), (name, figure)
        assert parse_bytes(spec.memory) > 64 * 2**30
    assert gpus["h100"].bf16_tflops == 989 and gpus["h20"].bf16_tflops == 148 and gpus["a100-80gb"].host_gbs == 32


def test_a_preset_fills_only_the_fields_left_at_their_default():
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig) if f.name in _DEFAULTS}
    assert defaults == _DEFAULTS
    h100 = PlanConfig(prompt_tokens=100, gpu="H100")
    assert h100.gpu_memory == 80 * 2**30 and h100.throughput_tflops == pytest.approx(989 * DEFAULT_EFFICIENCY)
    assert h100.intra_node_gbs == pytest.approx(900 / 2 * LINK_EFFICIENCY)
    assert h100.host_bandwidth_gbs == pytest.approx(64 * LINK_EFFICIENCY)
    mine = PlanConfig(prompt_tokens=100, gpu="h100", throughput_tflops=123.0, gpu_memory="70GiB")
    assert mine.throughput_tflops == 123.0 and mine.gpu_memory == 70 * 2**30
    with pytest.raises(ConfigError, match="mi300x"):
        PlanConfig(prompt_tokens=100, gpu="v100")
    with pytest.raises(ConfigError, match="gpus_per_node"):
        PlanConfig(prompt_tokens=100, gpus_per_node=0)


def test_the_h20_efficiency_is_its_calibration_on_the_papers_capture():
    """DEFAULT_EFFICIENCY is what makes the paper's capture take 4,656 s (to its 4 digits):
    a change of the FLOP model shows here."""
    assert calibrate_h20() == pytest.approx(DEFAULT_EFFICIENCY, abs=5e-5)
    r = estimate("qwen3.6-27b", PlanConfig(gpu="h20", **PAPER_RUN))
    assert r["comm"]["phases"]["capture"]["time_s"] == pytest.approx(PAPER_CAPTURE_S, rel=1e-3)


@pytest.mark.parametrize("kw,paper", [({"group": 2}, 5198.8), ({"group": 8}, 6785.2)])
def test_the_papers_times_are_predicted_within_a_few_percent(kw, paper):
    r = estimate("qwen3.6-27b", PlanConfig(gpu="h20", **{**PAPER_RUN, **kw}))
    assert abs(r["estimated_time_s"] / paper - 1) < 0.03, r["estimated_time_s"]


def test_each_phase_follows_the_overlap_rule_by_hand():
    """A 16-rank exact run over 2 nodes: capture's and the walk's context-parallel bytes
    cross the inter-node link (the group spans nodes) and add to compute; FSDP gathers
    are prefetched (max); 4 data-parallel replicas all-reduce the gradients once; FSDP2
    reduce-scatters per backward pass."""
    kw = dict(prompt_tokens=262144, group=4, response_tokens=1024, gpus=16, mode="exact", lora_rank=16,
              shard_params=True, data_parallel=4, gpu="h100")
    r = estimate("qwen3-8b", PlanConfig(**kw))
    c = r["inputs"]
    ph = r["comm"]["phases"]
    assert set(ph["capture"]["bytes_by_link"]) == {"inter_node"}
    cap = ph["capture"]
    assert cap["bytes"]["context_parallel"] == r["capture_comm_bytes_per_rank"] > 0
    assert cap["blocking_s"] == pytest.approx(r["capture_comm_bytes_per_rank"] / (c["inter_node_gbs"] * 1e9))
    assert cap["compute_s"] == pytest.approx(r["flops_capture"] / (c["throughput_tflops"] * 1e12))
    assert cap["time_s"] == pytest.approx(max(cap["compute_s"] + cap["blocking_s"], cap["prefetched_s"]))
    assert ph["walk"]["bytes"]["context_parallel"] == r["walk_comm_bytes_per_rank"] > 0
    grads = ph["gradients"]["bytes"]
    assert grads["data_parallel"] == pytest.approx(2 * 3 / 4 * r["grad_bytes"])
    # FSDP2 reduce-scatters each backward pass's gradients (the LoRA adapters', whole: 16 x a rank's
    # shard), 15/16 of them: once per branch (one piece each) in replay, once per walk chunk
    assert "fsdp_reduce_scatter" not in grads
    assert ph["replay"]["bytes"]["fsdp_reduce_scatter"] == pytest.approx(4 * r["grad_bytes"] * 16 * 15 / 16)
    walk_rs = ph["walk"]["bytes"]["fsdp_reduce_scatter"] / (r["grad_bytes"] * 15)
    assert walk_rs == pytest.approx(round(walk_rs)) and walk_rs >= 1  # whole walk chunks
    total = sum(p["time_s"] for k, p in ph.items() if k != "offload")
    assert r["estimated_time_s"] == pytest.approx(total)
    # within one node the same bytes take the intra-node link
    one_node = estimate("qwen3-8b", PlanConfig(**dict(kw, gpus_per_node=16)))
    assert set(one_node["comm"]["phases"]["capture"]["bytes_by_link"]) == {"intra_node"}
    assert one_node["estimated_time_s"] < r["estimated_time_s"]


def test_the_cli_takes_a_gpu_preset(capsys):
    args = ["plan", "--model", "qwen3.6-27b", "--prompt-tokens", "65536", "--group", "2", "--response-tokens", "512",
            "--gpus", "8", "--gpu", "h200"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["gpu"] == "h200" and r["gpu_memory_bytes"] == 141 * 10**9 and "comm" in r
    assert r["inputs"]["throughput_tflops"] == pytest.approx(gpu_spec("h200").effective_tflops)
    assert main(args) == 0
    assert "TIME with communication" in capsys.readouterr().out
