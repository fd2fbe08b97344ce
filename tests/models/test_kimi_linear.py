"""Kimi Linear (KDA + NoPE MLA + MoE) against the stock HF model, a tiny random config
(`tests/reference.py: tiny_kimi`), float64.

HF's float32 casts (the KDA kernel's `.to(torch.float32)` of q, k, v, g and beta, the
forget gate's `.float()`, the RMSNorms and the gated o_norm, the MoE router) are made
float64 on both sides by `float64_internals`; none had to stay float32. HF's torch
fallbacks (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`,
`causal_conv1d_fn` / `_update`) are the reference: flash-linear-attention and
causal-conv1d are not installed here. The detached reference is HF's cached
continuation with explicit position ids, its linear-attention cache made out of place
(`hf_cached_logprobs_positioned`).
"""

import pytest
import torch

import longstraw as ls
from longstraw.state.prompt import MLAState, RecurrentState
from tests.models.hf_checks import check_greedy_generate, check_lora, check_offload, check_score, check_step
from tests.reference import tiny_kimi
from tests.ranks import WORLDS, spawn

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
                "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj"]
"""The KDA mixers' own projections (the forget gate's too), MLA's, and the MLPs'."""


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_step_equals_hf(mode):
    check_step(tiny_kimi(), mode)


def test_score_equals_hf_full_sequence():
    check_score(tiny_kimi())


def test_greedy_generate_equals_hf():
    check_greedy_generate(tiny_kimi())


def test_lora_gradients_equal_hf():
    pytest.importorskip("peft")
    check_lora(tiny_kimi(), LORA_TARGETS, "forget_gate.f_a_proj.lora_A")


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_offloaded_step_equals_on_device(mode):
    check_offload(tiny_kimi(), mode)


def test_state_is_constant_in_p_for_the_kda_layers():
    """Recurrent state [H, Dk, Dv] + one conv tail [3 H Dk, K-1] per KDA layer, whatever
    P; one latent row [kv_lora_rank + rope dim] per position for the MLA layer."""
    model = tiny_kimi()
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
    sizes = []
    for p in (9, 17):
        state = engine.capture(torch.randint(0, 97, (p,), generator=torch.Generator().manual_seed(p)))
        assert [type(s).__name__ for s in state.layers] == ["RecurrentState", "MLAState", "RecurrentState",
                                                             "RecurrentState"]
        for s in state.layers:
            if isinstance(s, RecurrentState):
                (pos, (rec, tail)), = s.snapshots.items()
                assert pos == p - 1 and rec.shape == (4, 8, 8) and tail.shape == (3 * 4 * 8, 3)
            if isinstance(s, MLAState):
                assert s.latent.k.shape[-2:] == (p - 1, 16 + 8) and s.index is None
        sizes.append(sum(s.nbytes() for s in state.layers if isinstance(s, RecurrentState)))
    assert sizes[0] == sizes[1] == 3 * 8 * (4 * 8 * 8 + 96 * 3)


@pytest.mark.parametrize("world", WORLDS)
def test_context_parallel_equals_one_process(tmp_path, world):
    """Divided capture (conv tails from the previous block's owner, each segment's
    affine KDA transition, the relay across ranks; MLA's divided latent attention) and
    divided reverse walk, gloo on CPU: loss and every .grad equal one process. Blocks of
    3 positions put segment boundaries inside every capture chunk (6)."""

    from tests import distributed_worker as worker

    spawn(worker.run_cases, args=(world, str(tmp_path / "init"), ["kimi_linear"], ["detached", "exact"]),
          nprocs=world, join=True)
