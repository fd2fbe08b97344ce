"""The planner's recurrent hybrids (`plan/hybrid_arch.py`): Mamba2 hybrids and Kimi
Linear. Their presets' state worked out by hand (constant in P for the recurrent
layers), and parameter counts equal to the stock HF models' own (tiny configs)."""

import pytest

from longstraw.plan import PlanConfig, estimate
from longstraw.plan.arch import architecture, count_parameters

MiB = 2**20


def plan(model, prompt_tokens):
    return estimate(model, PlanConfig(prompt_tokens=prompt_tokens, group=8, response_tokens=1024))


@pytest.mark.parametrize("p", [131_072, 1_048_576])
def test_nemotron_h_56b_state_by_hand(p):
    """10 attention layers keep K/V: 8 kv heads x 128 x 2 (K and V) x 2 B per token. 54
    Mamba2 layers keep an fp32 SSM state [256 heads, 64, 256] (16 MiB) and a bf16 conv
    tail [16384 + 2 x 8 x 256, 3], whatever P."""
    r = plan("nemotron-h-56b", p)
    assert r["state_bytes_per_token"] == 10 * 8 * 128 * 2 * 2 == 40_960
    assert r["breakdown"]["state"]["recurrent_fixed"] == 54 * 256 * 64 * 256 * 4 == 54 * 16 * MiB
    assert r["breakdown"]["state"]["conv_tail_fixed"] == 54 * (16384 + 2 * 8 * 256) * 3 * 2
    assert r["state_bytes_fixed"] == 912_605_184
    assert r["layer_counts"] == {"full_attention": 10, "mamba2": 54}


@pytest.mark.parametrize("p", [131_072, 1_048_576])
def test_kimi_linear_48b_state_by_hand(p):
    """7 MLA layers keep one latent row (512 + 64) x 2 B per token; 20 KDA layers an fp32
    state [32 heads, 128, 128] (2 MiB) and a bf16 conv tail [3 x 32 x 128, 3], whatever P."""
    r = plan("kimi-linear-48b-a3b", p)
    assert r["state_bytes_per_token"] == 7 * (512 + 64) * 2 == 8_064
    assert r["breakdown"]["state"]["recurrent_fixed"] == 20 * 32 * 128 * 128 * 4 == 40 * MiB
    assert r["breakdown"]["state"]["conv_tail_fixed"] == 20 * 3 * 32 * 128 * 3 * 2
    assert r["state_bytes_fixed"] == 43_417_600
    assert r["layer_counts"] == {"kimi_delta_attention": 20, "mla": 7, "moe": 26}


@pytest.mark.parametrize("p", [131_072, 1_048_576])
def test_granite_4_h_small_state_by_hand(p):
    """4 NoPE attention layers keep K/V: 8 kv heads x 128 x 2 x 2 B per token. 36 Mamba2
    layers keep an fp32 SSM state [128 heads, 64, 128] (4 MiB) and a bf16 conv tail
    [8192 + 2 x 1 x 128, 3], whatever P; every layer's MLP is a 72-expert MoE."""
    r = plan("granite-4.0-h-small", p)
    assert r["state_bytes_per_token"] == 4 * 8 * 128 * 2 * 2 == 16_384
    assert r["breakdown"]["state"]["recurrent_fixed"] == 36 * 128 * 64 * 128 * 4 == 36 * 4 * MiB
    assert r["breakdown"]["state"]["conv_tail_fixed"] == 36 * (8192 + 2 * 1 * 128) * 3 * 2
    assert r["state_bytes_fixed"] == 152_819_712
    assert r["layer_counts"] == {"full_attention": 4, "mamba2": 36, "moe": 40}


@pytest.mark.parametrize("name", ["nemotron-h-56b", "kimi-linear-48b-a3b", "granite-4.0-h-small"])
def test_preset_parameter_counts_equal_the_full_size_hf_model(name):
    """The preset's own config built as the stock HF model on the meta device (no
    memory): the planner counts exactly its parameters, and that total is within 2% of
    the published one (the presets' acceptance rule)."""
    import torch
    import transformers

    from longstraw.plan import load_presets

    preset = load_presets()[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**preset["config"]))
    total = sum(p.numel() for p in model.parameters())
    assert count_parameters(architecture(preset["config"])).total == total
    assert abs(total - preset["num_parameters"]) <= 0.02 * preset["num_parameters"], (total, preset["num_parameters"])


def _tiny_models():
    from tests.reference import tiny_falcon_h1, tiny_kimi, tiny_mamba

    return {"kimi_linear": tiny_kimi, "falcon_h1": tiny_falcon_h1, "falcon_h1_norm": lambda: tiny_falcon_h1(
        mamba_rms_norm=True), **{f: (lambda f=f: tiny_mamba(f)) for f in ("nemotron_h", "bamba", "granitemoehybrid")}}


@pytest.mark.parametrize("name", ["kimi_linear", "falcon_h1", "falcon_h1_norm", "nemotron_h", "bamba",
                                  "granitemoehybrid"])
def test_parameter_counts_equal_the_hf_models(name):
    """KDA's projections (forget and output gates' low-rank pairs), Mamba2's in_proj with
    or without bias, relu2 MLPs and experts, Nemotron-H's merged blocks, Falcon-H1's two
    specs per layer: every parameter of the stock model is counted once."""
    model = _tiny_models()[name]()
    arch = architecture(model.config.to_dict())
    assert count_parameters(arch).total == sum(p.numel() for p in model.parameters())
