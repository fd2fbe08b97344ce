"""Exact mode: the loss and every parameter gradient equal one full-sequence HF
forward/backward per branch over prompt + response (float64).

Stock HF RMSNorm rounds every gradient that crosses it to float32 (it casts to float32
and back). Exact mode sums a prompt token's state gradient over branches before that
rounding; per-branch autograd rounds each share. So against the stock model the two
agree to ~1e-7 (float32), and with the norms computing in float64 (`float64_norms`,
applied to the one model both sides use) they agree to 1e-9 and better (~1e-14).
"""

import pytest
import torch

import longstraw as ls
from tests.reference import (
    FAMILIES,
    assert_grads_close,
    assert_loss_close,
    float64_norms,
    grads_of,
    hf_full_logprobs,
    random_group,
    reference_grpo_loss,
    tiny_model,
)


def _full_sequence_reference(model, group, **grpo_kwargs):
    model.zero_grad(set_to_none=True)
    logps = [hf_full_logprobs(model, group.prompt, r) for r in group.responses]
    loss = reference_grpo_loss(logps, group, **grpo_kwargs)
    loss.backward()
    return float(loss.detach()), grads_of(model)


def _step(model, group, **exec_kwargs):
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, ls.ExecConfig(mode="exact", **exec_kwargs)).step(group, ls.GRPOConfig())
    return result, grads_of(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_equals_full_sequence_autograd(family):
    model = float64_norms(tiny_model(family))
    group = random_group(97, 21, [5, 1, 8], seed=11)
    result, got = _step(model, group, chunk_size=6, attention_block_size=4)
    loss, want = _full_sequence_reference(model, group)
    assert_loss_close(result.loss, loss)
    assert_grads_close(got, want, 1e-9)
    assert result.metrics["state_grad_bytes"] == result.metrics["state_bytes"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_exact_on_stock_norms_agrees_to_float32_rounding(family):
    model = tiny_model(family)
    group = random_group(97, 21, [5, 1, 8], seed=11)
    _, got = _step(model, group, chunk_size=6)
    _, want = _full_sequence_reference(model, group)
    assert_grads_close(got, want, 1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_exact_chunking_changes_nothing(chunk):
    model = float64_norms(tiny_model("qwen3"))
    group = random_group(97, 16, [4, 6], seed=12)
    _, got = _step(model, group, chunk_size=chunk, attention_block_size=3)
    _, want = _full_sequence_reference(model, group)
    assert_grads_close(got, want, 1e-9)


def test_exact_with_sliding_window_layers():
    model = float64_norms(tiny_model("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1))
    group = random_group(97, 17, [3, 6], seed=13)
    _, got = _step(model, group, chunk_size=4)
    _, want = _full_sequence_reference(model, group)
    assert_grads_close(got, want, 1e-9)


def test_exact_minus_detached_is_the_prompt_path_and_is_not_zero():
    """Exact = detached + the prompt-path contribution; show that contribution is real."""
    model = float64_norms(tiny_model("llama"))
    group = random_group(97, 14, [4, 5], seed=14)
    _, exact = _step(model, group, chunk_size=5)
    model.zero_grad(set_to_none=True)
    ls.Engine(model, ls.ExecConfig(chunk_size=5)).step(group, ls.GRPOConfig())
    detached = grads_of(model)
    _, full = _full_sequence_reference(model, group)
    prompt_path = {n: exact[n] - detached[n] for n in exact}
    # The prompt path touches every projection that feeds the captured K/V.
    k_proj = [n for n in prompt_path if "k_proj.weight" in n]
    assert all(prompt_path[n].norm() > 1e-3 * exact[n].norm() for n in k_proj)
    # and it is exactly the difference between the full-sequence and detached gradients
    assert_grads_close({n: detached[n] + prompt_path[n] for n in exact}, full, 1e-9)
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([detached[n].flatten() for n in exact]), torch.cat([full[n].flatten() for n in exact]), dim=0)
    assert cos < 1 - 1e-8


def test_exact_with_lora_only_lora_grads():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(float64_norms(tiny_model("qwen3")), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)).eval()
    group = random_group(97, 13, [4, 3], seed=15)
    _, got = _step(model, group, chunk_size=4)
    _, want = _full_sequence_reference(model, group)
    assert_grads_close(got, want, 1e-9)
    assert all(("lora_" in n) == (g is not None) for n, g in got.items())


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_branch_pieces_exact_mode(piece):
    model = float64_norms(tiny_model("qwen3"))
    group = random_group(97, 12, [7, 1, 5], seed=16)
    _, got = _step(model, group, chunk_size=5, branch_chunk_size=piece)
    _, want = _full_sequence_reference(model, group)
    assert_grads_close(got, want, 1e-9)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("mistral", dict(sliding_window=4))])
@pytest.mark.parametrize("piece", [1, 4])
def test_branch_pieces_detached_mode_equal_unchunked_replay(family, overrides, piece):
    from tests.reference import hf_cached_logprobs

    model = tiny_model(family, **overrides)
    group = random_group(97, 11, [9, 2], seed=17)
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, ls.ExecConfig(chunk_size=4, branch_chunk_size=piece)).step(group, ls.GRPOConfig())
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss = reference_grpo_loss([hf_cached_logprobs(model, group.prompt, r) for r in group.responses], group)
    loss.backward()
    assert_loss_close(result.loss, float(loss.detach()))
    assert_grads_close(got, grads_of(model), 1e-9)


def test_bf16_exact_mode_sums_state_gradients_in_float32():
    """bf16 exact mode against float64 on the same (bf16-rounded) weights.

    Setup: a 1-layer bf16 llama, a 6-token prompt of tokens that appear nowhere else,
    and 2k = 640 one-token branches: k copies of response A (reward 1), then k of B
    (reward 0). The embedding rows of the prompt-only tokens get their gradient from one
    place only: the reverse walk, seeded by the prompt state's gradient, which is the
    sum of k identical contributions of A's branch, then k of B's.

    Bound. Let u = 2^-8 (bf16 unit roundoff). With float32 buffers the sum of 640 terms
    adds at most 640 * 2^-24 < 2^-14 relative, so the error is that of one A and one B
    branch computed in bf16. Along that path a value is rounded to bf16 at most ~16
    times (forward: embedding, norm, q/k/v projections, RoPE, attention output, o_proj,
    residual, final norm, lm_head; backward: the seed cast to bf16, then k/v
    projections, RoPE, norm, embedding), each adding <= u relative, with O(1)
    condition numbers at this size, so ||err|| / ||ref|| <= 16 u = 0.0625 (measured:
    ~2 u). With bf16 buffers, adding the k-th identical term to a sum that is >= 256
    times larger rounds it away (it is below half an ulp), so the sum stalls near 256
    terms instead of 320 and the rows are off by ~0.2 - 0.5 relative (measured 126 u).
    """
    k = 320
    model = tiny_model("llama", dtype=torch.bfloat16, num_hidden_layers=1)
    prompt = torch.tensor([20, 21, 22, 23, 24, 3])
    a, b = torch.tensor([5]), torch.tensor([11])
    group = ls.Group(prompt=prompt, responses=[a] * k + [b] * k,
                     rewards=torch.tensor([1.0] * k + [0.0] * k, dtype=torch.float64))

    def prompt_rows(m):
        m.zero_grad(set_to_none=True)
        ls.Engine(m, ls.ExecConfig(mode="exact", chunk_size=8)).step(group)
        return m.model.embed_tokens.weight.grad[prompt[:-1]].double()

    got = prompt_rows(model)
    want = prompt_rows(model.double())
    u = 2.0 ** -8
    assert (got - want).norm() <= 16 * u * want.norm(), float((got - want).norm() / want.norm() / u)


@pytest.mark.parametrize("trainable", ["layers.0.self_attn.v_proj.weight", "layers.0.self_attn.k_proj.weight"])
@pytest.mark.parametrize("chunk", [4, 100])
def test_frozen_queries_still_carry_state_gradients(trainable, chunk):
    """Only one projection of the first layer trains (as LoRA on v_proj leaves embeddings,
    q and k frozen): the prompt state's gradient sinks must fill although nothing upstream
    needs dq, and dv alone must be computed when dk is not needed."""
    model = float64_norms(tiny_model("qwen3"))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(trainable))
    group = random_group(97, 9, [3, 4], seed=7)
    result, got = _step(model, group, chunk_size=chunk)
    loss, want = _full_sequence_reference(model, group)
    assert_loss_close(result.loss, loss)
    assert_grads_close(got, want, 1e-9)
