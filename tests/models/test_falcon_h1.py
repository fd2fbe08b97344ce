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
from tests.engine.test_rollout import _hf_greedy
from tests.reference import (
    compare_step,
    float64_internals,
    hf_cached_logprobs_positioned,
    hf_full_logprobs,
    random_group,
    tiny_falcon_h1,
)

EXEC = dict(chunk_size=4, attention_block_size=3)  # chunks that divide neither P nor the SSD chunk (8)
LORA_TARGETS = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_step_equals_hf(mode):
    model = tiny_falcon_h1()
    lens = [4, 2, 7] if mode == "detached" else [4, 1, 7]
    group = random_group(97, 13, lens, seed=1)
    reference = hf_cached_logprobs_positioned if mode == "detached" else hf_full_logprobs
    with float64_internals():
        result = compare_step(model, group, ls.ExecConfig(mode=mode, **EXEC), reference, 1e-9)
    assert (result.metrics["state_grad_bytes"] > 0) == (mode == "exact")


def test_score_equals_hf_full_sequence():
    model = tiny_falcon_h1()
    group = random_group(97, 14, [6, 1], seed=2)
    with float64_internals(), torch.no_grad():
        got = ls.Engine(model, ls.ExecConfig(chunk_size=5)).score(group)
        for s, r in zip(got, group.responses):
            torch.testing.assert_close(s, hf_full_logprobs(model, group.prompt, r), rtol=0, atol=1e-10)


def test_greedy_generate_equals_hf():
    model = tiny_falcon_h1()
    prompt = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(4))
    with float64_internals():
        greedy = ls.Engine(model, ls.ExecConfig(chunk_size=2)).generate(prompt, num_samples=2, max_new_tokens=9,
                                                                         temperature=0)
        hf = _hf_greedy(model, prompt, 9)
    assert all(torch.equal(r, hf) for r in greedy.responses), ([r.tolist() for r in greedy.responses], hf.tolist())


def test_lora_gradients_equal_hf():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_falcon_h1(), peft.LoraConfig(
        r=2, target_modules=LORA_TARGETS, init_lora_weights=False)).eval()
    group = random_group(97, 11, [3, 5], seed=6)
    with float64_internals():
        compare_step(model, group, ls.ExecConfig(mode="exact", **EXEC), hf_full_logprobs, 1e-9)
    assert all(("lora_" in n) == (p.grad is not None) for n, p in model.named_parameters())
    assert any("mamba.in_proj.lora_A" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_offloaded_step_equals_on_device(mode):
    from tests.state.test_offload import assert_same_step

    with float64_internals():
        assert_same_step(tiny_falcon_h1(), random_group(97, 13, [4, 6], seed=2), dict(mode=mode, **EXEC))


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


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_equals_one_process(tmp_path, world):
    """Both divided paths in one layer (the attention's sharded K/V, the mixer's segment
    transitions and relay), capture and reverse walk, gloo on CPU: loss and every .grad
    equal one process. Blocks of 3 positions cut every capture chunk (6)."""
    import torch.multiprocessing as mp

    from tests import distributed_worker as worker

    mp.spawn(worker.run_cases, args=(world, str(tmp_path / "init"), ["falcon_h1"], ["detached", "exact"]),
             nprocs=world, join=True)
