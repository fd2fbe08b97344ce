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
from tests.engine.test_rollout import _hf_greedy
from tests.reference import (
    compare_step,
    float64_internals,
    hf_cached_logprobs_positioned,
    hf_full_logprobs,
    random_group,
    tiny_kimi,
)

EXEC = dict(chunk_size=4, attention_block_size=3)  # chunks that divide neither P nor the KDA chunk
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
                "kv_a_proj_with_mqa", "gate_proj", "up_proj", "down_proj"]
"""The KDA mixers' own projections (the forget gate's too), MLA's, and the MLPs'."""


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_step_equals_hf(mode):
    model = tiny_kimi()
    lens = [4, 2, 7] if mode == "detached" else [4, 1, 7]
    group = random_group(97, 13, lens, seed=1)
    reference = hf_cached_logprobs_positioned if mode == "detached" else hf_full_logprobs
    with float64_internals():
        result = compare_step(model, group, ls.ExecConfig(mode=mode, **EXEC), reference, 1e-9)
    assert (result.metrics["state_grad_bytes"] > 0) == (mode == "exact")


def test_score_equals_hf_full_sequence():
    model = tiny_kimi()
    group = random_group(97, 14, [6, 1], seed=2)
    with float64_internals(), torch.no_grad():
        got = ls.Engine(model, ls.ExecConfig(chunk_size=5)).score(group)
        for s, r in zip(got, group.responses):
            torch.testing.assert_close(s, hf_full_logprobs(model, group.prompt, r), rtol=0, atol=1e-10)


def test_greedy_generate_equals_hf():
    model = tiny_kimi()
    prompt = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(4))
    with float64_internals():
        greedy = ls.Engine(model, ls.ExecConfig(chunk_size=2)).generate(prompt, num_samples=2, max_new_tokens=9,
                                                                         temperature=0)
        hf = _hf_greedy(model, prompt, 9)
    assert all(torch.equal(r, hf) for r in greedy.responses), ([r.tolist() for r in greedy.responses], hf.tolist())


def test_lora_gradients_equal_hf():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_kimi(), peft.LoraConfig(
        r=2, target_modules=LORA_TARGETS, init_lora_weights=False)).eval()
    group = random_group(97, 11, [3, 5], seed=6)
    with float64_internals():
        compare_step(model, group, ls.ExecConfig(mode="exact", **EXEC), hf_full_logprobs, 1e-9)
    assert all(("lora_" in n) == (p.grad is not None) for n, p in model.named_parameters())
    assert any("forget_gate.f_a_proj.lora_A" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_offloaded_step_equals_on_device(mode):
    from tests.state.test_offload import assert_same_step

    with float64_internals():
        assert_same_step(tiny_kimi(), random_group(97, 13, [4, 6], seed=2), dict(mode=mode, **EXEC))


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


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_equals_one_process(tmp_path, world):
    """Divided capture (conv tails from the previous block's owner, each segment's
    affine KDA transition, the relay across ranks; MLA's divided latent attention) and
    divided reverse walk, gloo on CPU: loss and every .grad equal one process. Blocks of
    3 positions put segment boundaries inside every capture chunk (6)."""
    import torch.multiprocessing as mp

    from tests import distributed_worker as worker

    mp.spawn(worker.run_cases, args=(world, str(tmp_path / "init"), ["kimi_linear"], ["detached", "exact"]),
             nprocs=world, join=True)
