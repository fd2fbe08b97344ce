"""The engine against the stock HF model's cached continuation, per family, float64."""

import pytest
import torch

import longstraw as ls
from tests.reference import (
    FAMILIES,
    assert_grads_close,
    assert_loss_close,
    grads_of,
    hf_cached_logprobs,
    random_group,
    reference_grpo_loss,
    tiny_model,
)


def _engine_step(model, group, exec_cfg, grpo):
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, exec_cfg).step(group, grpo)
    return result, grads_of(model)


def _reference_step(model, group, grpo_kwargs, temperature=1.0):
    model.zero_grad(set_to_none=True)
    logps = [hf_cached_logprobs(model, group.prompt, r, temperature) for r in group.responses]
    loss = reference_grpo_loss(logps, group, **grpo_kwargs)
    loss.backward()
    return float(loss.detach()), grads_of(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_step_and_score_match_hf_cached_continuation(family):
    model = tiny_model(family)
    group = random_group(97, 23, [5, 1, 9], seed=1)
    result, got = _engine_step(model, group, ls.ExecConfig(chunk_size=7, attention_block_size=5), ls.GRPOConfig())
    loss, want = _reference_step(model, group, {})
    assert_loss_close(result.loss, loss)
    assert_grads_close(got, want, 1e-9)

    scores = ls.Engine(model, ls.ExecConfig(chunk_size=4)).score(group)
    with torch.no_grad():
        for s, r in zip(scores, group.responses):
            torch.testing.assert_close(s, hf_cached_logprobs(model, group.prompt, r), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family,overrides", [
    ("mistral", dict(sliding_window=6)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
])
def test_sliding_window_layers_match_hf(family, overrides):
    model = tiny_model(family, **overrides)
    group = random_group(97, 19, [4, 8], seed=3)
    result, got = _engine_step(model, group, ls.ExecConfig(chunk_size=4, attention_block_size=3), ls.GRPOConfig())
    loss, want = _reference_step(model, group, {})
    assert_loss_close(result.loss, loss)
    assert_grads_close(got, want, 1e-9)
    # windowed layers hold only W - 1 positions, full layers all P - 1
    state = ls.Engine(model, ls.ExecConfig(chunk_size=4)).capture(group.prompt)
    for layer, kv in enumerate(state.layers):
        expected = kv.window - 1 if kv.window else group.prompt.numel() - 1
        assert kv.k.shape[1] == expected, layer


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunk_size_changes_nothing(chunk):
    model = tiny_model("qwen3")
    group = random_group(97, 17, [3, 6], seed=2)
    _, base = _engine_step(model, group, ls.ExecConfig(chunk_size=4), ls.GRPOConfig())
    _, got = _engine_step(model, group, ls.ExecConfig(chunk_size=chunk, attention_block_size=chunk), ls.GRPOConfig())
    assert_grads_close(got, base, 1e-11)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_each_loss_type_off_policy_with_kl_and_temperature(loss_type):
    model = tiny_model("llama")
    group = random_group(97, 13, [4, 7, 2], seed=4)
    g = torch.Generator().manual_seed(9)
    group.old_logprobs = [s + 0.3 * torch.randn(s.shape, generator=g, dtype=s.dtype)
                          for s in ls.Engine(model).score(group)]
    group.ref_logprobs = [s - 0.2 * torch.rand(s.shape, generator=g, dtype=s.dtype) for s in group.old_logprobs]
    kw = dict(loss_type=loss_type, epsilon_low=0.1, epsilon_high=0.28, beta=0.05, scale_rewards="none",
              max_completion_length=12 if loss_type == "dr_grpo" else None)
    grpo = ls.GRPOConfig(temperature=0.7, **kw)
    result, got = _engine_step(model, group, ls.ExecConfig(chunk_size=5), grpo)
    loss, want = _reference_step(model, group, kw, temperature=0.7)
    assert_loss_close(result.loss, loss)
    assert_grads_close(got, want, 1e-9)
    assert 0 < result.metrics["clip_fraction"] < 1 and result.metrics["kl_mean"] > 0


def test_all_equal_rewards_skip_replay_and_leave_grads():
    model = tiny_model("qwen2")
    group = random_group(97, 9, [3, 4], rewards=[0.1, 0.1])
    result = ls.Engine(model).step(group, ls.GRPOConfig())
    assert result.loss == 0.0 and result.metrics["skipped_zero_advantage"] == 1.0
    assert all(p.grad is None for p in model.parameters())


def test_batch_of_groups_equals_one_batch_loss():
    model = tiny_model("qwen3")
    groups = [random_group(97, 11, [3, 5], seed=5), random_group(97, 8, [6, 2, 4], seed=6)]
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        grpo = ls.GRPOConfig(loss_type=loss_type)
        totals = ls.BatchTotals.of(groups)
        model.zero_grad(set_to_none=True)
        engine = ls.Engine(model, ls.ExecConfig(chunk_size=4))
        loss = sum(engine.step(g, grpo, totals=totals).loss for g in groups)
        got = grads_of(model)
        # one batch loss: per-group advantages, batch-wide normaliser
        model.zero_grad(set_to_none=True)
        kw = dict(loss_type=loss_type, num_sequences=totals.num_sequences, num_tokens=totals.num_tokens,
                  max_completion_length=totals.max_response_tokens)
        ref = 0
        for g in groups:
            logps = [hf_cached_logprobs(model, g.prompt, r) for r in g.responses]
            ref = ref + reference_grpo_loss(logps, g, **kw)
        ref.backward()
        assert_loss_close(loss, float(ref))
        assert_grads_close(got, grads_of(model), 1e-9)
