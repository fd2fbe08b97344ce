"""The checks every recurrent-hybrid family runs against its stock HF model (float64,
HF's float32 casts made float64: `float64_internals`): step in both modes, score,
greedy generate, LoRA gradients, offload. Each takes a model (or a model factory) and
asserts; the family test files parametrize them."""

import torch

import longstraw as ls
from tests.engine.test_rollout import _hf_greedy
from tests.reference import (
    compare_step,
    float64_internals,
    hf_cached_logprobs_positioned,
    hf_full_logprobs,
    random_group,
)

EXEC = dict(chunk_size=4, attention_block_size=3)  # chunks that divide neither P nor an SSD / KDA chunk


def check_step(model, mode: str) -> None:
    """Detached: HF's cached continuation (responses of 2+ tokens: HF's one-token cached
    recurrent step writes its state in place, which autograd cannot differentiate);
    exact: one full sequence per branch (a one-token response included)."""
    lens = [4, 2, 7] if mode == "detached" else [4, 1, 7]
    group = random_group(97, 13, lens, seed=1)
    reference = hf_cached_logprobs_positioned if mode == "detached" else hf_full_logprobs
    with float64_internals():
        result = compare_step(model, group, ls.ExecConfig(mode=mode, **EXEC), reference, 1e-9)
    assert (result.metrics["state_grad_bytes"] > 0) == (mode == "exact")


def check_score(model) -> None:
    group = random_group(97, 14, [6, 1], seed=2)
    with float64_internals(), torch.no_grad():
        got = ls.Engine(model, ls.ExecConfig(chunk_size=5)).score(group)
        for s, r in zip(got, group.responses):
            torch.testing.assert_close(s, hf_full_logprobs(model, group.prompt, r), rtol=0, atol=1e-10)


def check_greedy_generate(model) -> None:
    prompt = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(4))
    with float64_internals():
        greedy = ls.Engine(model, ls.ExecConfig(chunk_size=2)).generate(prompt, num_samples=2, max_new_tokens=9,
                                                                         temperature=0)
        hf = _hf_greedy(model, prompt, 9)
    assert all(torch.equal(r, hf) for r in greedy.responses), ([r.tolist() for r in greedy.responses], hf.tolist())


def check_lora(model, targets, own: str) -> None:
    """LoRA (rank 2, random B) on `targets`: exact-mode gradients equal HF's, only LoRA
    parameters get one, and `own` (a name fragment) shows the mixers' own projections
    were wrapped."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)).eval()
    group = random_group(97, 11, [3, 5], seed=6)
    with float64_internals():
        compare_step(model, group, ls.ExecConfig(mode="exact", **EXEC), hf_full_logprobs, 1e-9)
    assert all(("lora_" in n) == (p.grad is not None) for n, p in model.named_parameters())
    assert any(own in n for n, _ in model.named_parameters())


def check_offload(model, mode: str) -> None:
    from tests.state.test_offload import assert_same_step

    with float64_internals():
        assert_same_step(model, random_group(97, 13, [4, 6], seed=2), dict(mode=mode, **EXEC))
