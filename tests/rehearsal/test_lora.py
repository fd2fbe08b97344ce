"""LoRA in a rehearsal: the planner's adapters (`ls.rehearse(..., lora_rank=r)`) and a stock
PEFT model's own, against the same real PEFT step measured by the same tracker."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

import longstraw as ls
from longstraw.budget import planner_config
from longstraw.plan.arch import architecture, count_parameters
from longstraw.rehearsal.lora import target_modules, with_lora
from longstraw.tiny import tiny_model

from .test_rehearse import G, P, R, _close, _real, _slow

FAMILIES = ["qwen3", "qwen3_5", "glm_moe_dsa", "nemotron_h", "kimi_linear"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_adapters_are_the_ones_the_planner_counts(family, targets):
    """The rehearsal's LoRA trains exactly `count_parameters(...).lora` parameters, and
    nothing else: no routed expert (PEFT's v4 conversion would adapt GLM's fused experts
    in place of its shared experts), no DSA indexer, no router, no Mamba2 out_proj (PEFT
    refuses it on Nemotron-H; the planner counted it before)."""
    config = tiny_model(family).config
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    trained = with_lora(meta, 4, targets)
    got = {n: p.numel() for n, p in trained.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in got), [n for n in got if "lora_" not in n][:3]
    assert sum(got.values()) == count_parameters(architecture(planner_config(tiny_model(family))), 4, targets).lora
    assert not any("expert" in n and "shared" not in n for n in got) and not any("indexer" in n for n in got)


CASES = [("qwen3", "attention", dict(mode="detached")),
         _slow("qwen3", "all-linear", dict(mode="exact", branch_chunk_size=3)),
         ("qwen3_5", "all-linear", dict(mode="exact")),
         _slow("qwen3_5", "attention", dict(mode="detached", branch_chunk_size=3))]


@pytest.mark.parametrize("family,targets,fields", CASES)
def test_lora_rehearsal_peaks_equal_the_real_peft_step(family, targets, fields):
    """`lora_rank=4`: the rehearsal's peak and each phase's within 2% of the real step of
    the same PEFT model (base frozen, adapters trained); FLOPs per phase equal."""
    cfg = ls.ExecConfig(chunk_size=16, **fields)
    real = _real(with_lora(tiny_model(family), 4, targets), cfg)[0]
    reh = ls.rehearse(tiny_model(family).config, cfg, prompt_tokens=P, group=G, response_tokens=R, device="cpu",
                      dtype=torch.float32, lora_rank=4, lora_targets=targets)
    assert set(reh.phases) == set(real.phases) == {"capture", "replay", "walk"}
    assert _close(reh.peak_bytes_per_rank, real.peak_bytes), (reh.peak_bytes_per_rank, real.peak_bytes)
    for name, peak in real.phases.items():
        assert _close(reh.phases[name], peak), (name, reh.phases[name], peak)
    assert reh.flops == real.flops


def test_a_stock_peft_model_is_rehearsed_with_its_own_adapters():
    """A PEFT model of two adapters (one active, rank 8 on q/v; the other rank 2 on the
    MLP), its adapters in float64 beside float32 weights: the rehearsal builds the same
    adapters (names, shapes, dtypes, which are trained) and peaks as the real step."""
    model = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["gate_proj"]))
    for name, p in model.named_parameters():
        if ".default." in name:
            p.data = p.data.double()
    cfg = ls.ExecConfig(chunk_size=16, mode="detached")
    reh = ls.rehearse(model, cfg, prompt_tokens=P, group=G, response_tokens=R, device="cpu")
    real = _real(model, cfg)[0]
    # within 0.2% (40 KB): the float64 adapters and their gradients are 180 KB more than float32 ones
    assert _close(reh.peak_bytes_per_rank, real.peak_bytes, 0.002), (reh.peak_bytes_per_rank, real.peak_bytes)
    for name, peak in real.phases.items():
        assert _close(reh.phases[name], peak, 0.002), (name, reh.phases[name], peak)
    planner_like = ls.rehearse(tiny_model("qwen3"), cfg, prompt_tokens=P, group=G, response_tokens=R, device="cpu",
                               lora_rank=8)  # q/k/v/o in float32: not the model's adapters
    assert planner_like.peak_bytes_per_rank != reh.peak_bytes_per_rank


def test_lora_refusals_come_before_any_work():
    config = tiny_model("qwen3").config
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ls.ConfigError, match="lora_rank must be a positive int"):
            ls.rehearse(config, prompt_tokens=P, group=G, response_tokens=R, device="cpu", lora_rank=bad)
    with pytest.raises(ls.ConfigError, match="lora_targets must be one of"):
        ls.rehearse(config, prompt_tokens=P, group=G, response_tokens=R, device="cpu", lora_rank=4,
                    lora_targets="mlp")
    model = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ls.ConfigError, match="rehearsed with its own adapters"):
        ls.rehearse(model, prompt_tokens=P, group=G, response_tokens=R, device="cpu", lora_rank=4)
    assert target_modules(tiny_model("qwen3"), "attention")[0] == "model.layers.0.self_attn.q_proj"
