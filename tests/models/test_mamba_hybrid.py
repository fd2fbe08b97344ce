"""Mamba2 + attention hybrids (Nemotron-H, Bamba, Granite 4.0) against the stock HF
models, tiny random configs (`tests/reference.py: tiny_mamba`), float64.

HF's float32 casts (`A_log.float()`, `x.float()`, `B.float()`, `C.float()` in
`torch_forward`'s SSD, the RMSNorms and gated norms, MoE routers) are made float64 on
both sides by `float64_internals`; none had to stay float32. The detached reference
is HF's cached continuation with explicit position ids (`hf_cached_logprobs_positioned`).
Its responses are 2+ tokens: HF's one-token cached step writes the SSM state in place
(`selective_state_update`'s `state.copy_`), which autograd cannot differentiate; exact
mode's full-sequence reference covers a response of one token.
"""

import pytest
import torch

import longstraw as ls
from longstraw.state.prompt import AttentionKV, RecurrentState
from tests.models.hf_checks import check_greedy_generate, check_lora, check_offload, check_score, check_step
from tests.reference import MAMBA_FAMILIES, float64_internals, hf_full_logprobs, random_group, tiny_mamba
from tests.ranks import WORLDS, spawn

LORA_TARGETS = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "input_linear",
                "output_linear"]
"""Every linear layer PEFT allows on a Mamba model (it refuses LoRA on `out_proj` and `conv1d` there)."""


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", MAMBA_FAMILIES)
def test_step_equals_hf(family, mode):
    check_step(tiny_mamba(family), mode)


@pytest.mark.parametrize("family", MAMBA_FAMILIES)
def test_score_equals_hf_full_sequence(family):
    check_score(tiny_mamba(family))


@pytest.mark.parametrize("family", MAMBA_FAMILIES)
def test_greedy_generate_equals_hf(family):
    check_greedy_generate(tiny_mamba(family))


@pytest.mark.parametrize("family", MAMBA_FAMILIES)
def test_lora_gradients_equal_hf(family):
    pytest.importorskip("peft")
    check_lora(tiny_mamba(family), LORA_TARGETS, "in_proj.lora_A")  # the mixers' own projections


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", ["nemotron_h", "granitemoehybrid"])
def test_offloaded_step_equals_on_device(family, mode):
    check_offload(tiny_mamba(family), mode)


def test_state_is_constant_in_p_for_the_mamba_layers():
    """SSM state [H, P, N] + conv tail [conv_dim, K-1] per Mamba2 layer, whatever P;
    K/V per position for the attention layer; nothing for Nemotron-H's MLP / MoE blocks."""
    model = tiny_mamba("nemotron_h")
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
    sizes = []
    for p in (9, 17):
        state = engine.capture(torch.randint(0, 97, (p,), generator=torch.Generator().manual_seed(p)))
        kinds = [type(s).__name__ if s is not None else None for s in state.layers]
        assert kinds == ["RecurrentState", None, "AttentionKV", "RecurrentState", None, "RecurrentState"]
        for s in state.layers:
            if isinstance(s, RecurrentState):
                (pos, (ssm, tail)), = s.snapshots.items()
                assert pos == p - 1 and ssm.shape == (4, 5, 6) and tail.shape == (20 + 2 * 2 * 6, 3)
            if isinstance(s, AttentionKV):
                assert s.k.shape[1] == p - 1
        sizes.append(sum(s.nbytes() for s in state.layers if isinstance(s, RecurrentState)))
    assert sizes[0] == sizes[1] == 3 * 8 * (4 * 5 * 6 + 44 * 3)


def test_granite_logits_scaling_is_applied():
    """Granite divides its logits by `logits_scaling` (2.5 here) outside the decoder
    stack; without it the scores would differ from HF's."""
    model = tiny_mamba("granitemoehybrid")
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
    assert engine.adapter.lm_head.scale == pytest.approx(1 / 2.5)


def test_falcon_h1_parallel_layers_are_refused_clearly():
    """The serial-hybrid adapter holds one state per layer: a layer running attention and
    Mamba2 side by side is refused there (Falcon-H1 has its own adapter, `falcon_h1.py`)."""
    import transformers

    from longstraw.models.mamba_hybrid import MambaHybridAdapter

    config = transformers.FalconH1Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
                                         mamba_d_head=8, mamba_d_ssm=32, mamba_d_state=6, mamba_n_groups=1)
    model = transformers.FalconH1ForCausalLM(config).double().eval()
    with pytest.raises(ls.UnsupportedModelError, match="Falcon-H1"):
        MambaHybridAdapter(model)


@pytest.mark.parametrize("world", WORLDS)
def test_context_parallel_equals_one_process(tmp_path, world):
    """Divided capture (conv tails from the previous block's owner, each segment's
    diagonal-decay transition, the relay across ranks) and divided reverse walk, gloo on
    CPU: loss and every .grad equal one process. Blocks of 3 positions put segment
    boundaries inside every capture chunk (6) and SSD chunk (64)."""

    from tests import distributed_worker as worker

    spawn(worker.run_cases, args=(world, str(tmp_path / "init"), list(worker.MAMBA_CASES), ["detached", "exact"]),
          nprocs=world, join=True)


def test_time_step_limits_are_applied_as_hf_does():
    """Nemotron-H clamps dt at time_step_min from below; at 0.5 the clamp bites for
    many tokens here, and the scores still equal HF's full-sequence forward."""
    model = tiny_mamba("nemotron_h", time_step_min=0.5)
    assert model.model.layers[0].mixer.time_step_limit == (0.5, float("inf"))
    group = random_group(97, 14, [6], seed=2)
    with float64_internals(), torch.no_grad():
        got, = ls.Engine(model, ls.ExecConfig(chunk_size=5)).score(group)
        torch.testing.assert_close(got, hf_full_logprobs(model, group.prompt, group.responses[0]), rtol=0, atol=1e-10)
