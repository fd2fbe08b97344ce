"""Falcon-H1 (attention and Mamba2 side by side in every layer, muP multipliers)
against the stock HF model, a tiny random config with every multiplier away from 1
(`tests/reference.py: tiny_falcon_h1`), float64.

HF's float32 casts (the SSD's `A_log.float()` etc. in `torch_forward`, the RMSNorms
and the gated norm) are made float64 on both sides by `float64_internals`; none had
to stay float32. The detached reference is HF's cached continuation with explicit
position ids; its responses are 2+ tokens (HF's one-token cached Mamba2 step writes its
state in place, which autograd cannot differentiate; exact mode covers one token).
"""

import pytest
import torch

import longstraw as ls
from longstraw.state.prompt import AttentionKV, RecurrentState
from tests.models.hf_checks import check_greedy_generate, check_lora, check_offload, check_score, check_step
from tests.reference import tiny_falcon_h1
from tests.ranks import WORLDS, spawn

LORA_TARGETS = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_step_equals_hf(mode):
    check_step(tiny_falcon_h1(), mode)


def test_score_equals_hf_full_sequence():
    check_score(tiny_falcon_h1())


def test_greedy_generate_equals_hf():
    check_greedy_generate(tiny_falcon_h1())


def test_lora_gradients_equal_hf():
    pytest.importorskip("peft")
    check_lora(tiny_falcon_h1(), LORA_TARGETS, "mamba.in_proj.lora_A")


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_offloaded_step_equals_on_device(mode):
    check_offload(tiny_falcon_h1(), mode)


def test_each_layer_keeps_kv_and_a_constant_mamba_state():
    """Layer i's K/V at i (per position), its Mamba2 state at L + i (SSM state [H, P, N]
    + conv tail [conv_dim, K-1], whatever P); the mixers' layer_idx is restored after."""
    model = tiny_falcon_h1()
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
    sizes = []
    for p in (9, 17):
        state = engine.capture(torch.randint(0, 97, (p,), generator=torch.Generator().manual_seed(p)))
        assert [type(s).__name__ for s in state.layers] == ["AttentionKV"] * 3 + ["RecurrentState"] * 3
        for s in state.layers:
            if isinstance(s, RecurrentState):
                (pos, (ssm, tail)), = s.snapshots.items()
                assert pos == p - 1 and ssm.shape == (4, 8, 6) and tail.shape == (32 + 2 * 2 * 6, 3)
            if isinstance(s, AttentionKV):
                assert s.k.shape[-3:] == (2, p - 1, 8)
        sizes.append(sum(s.nbytes() for s in state.layers if isinstance(s, RecurrentState)))
    assert sizes[0] == sizes[1] == 3 * 8 * (4 * 8 * 6 + 56 * 3)
    assert [layer.mamba.layer_idx for layer in model.model.layers] == [0, 1, 2]


def test_lm_head_multiplier_is_applied():
    """Falcon-H1 multiplies its logits by lm_head_multiplier (0.6 here) outside the
    decoder stack; the adapter's lm_head does it."""
    engine = ls.Engine(tiny_falcon_h1(), ls.ExecConfig(chunk_size=4))
    assert engine.adapter.lm_head.scale == pytest.approx(0.6)


@pytest.mark.parametrize("world", WORLDS)
def test_context_parallel_equals_one_process(tmp_path, world):
    """Both divided paths in one layer (the attention's sharded K/V, the mixer's segment
    transitions and relay), capture and reverse walk, gloo on CPU: loss and every .grad
    equal one process. Blocks of 3 positions cut every capture chunk (6)."""

    from tests import distributed_worker as worker

    spawn(worker.run_cases, args=(world, str(tmp_path / "init"), ["falcon_h1"], ["detached", "exact"]),
          nprocs=world, join=True)
