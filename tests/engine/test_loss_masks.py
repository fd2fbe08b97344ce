"""`Group(loss_masks=..., advantages=...)` against HF, float64.

A False token stays in the sequence (later tokens attend to it) but has no loss term
and is counted in no normaliser: TRL's `tool_mask`. The reference is HF's own model
(the cached continuation for detached mode, the full prompt + response forward for
exact mode) with the loss written from TRL's formulas, mask included
(`reference.reference_grpo_loss`). Groups are off-policy with a KL term, and masked
tokens carry old / ref log-probs of 0.0 (what a rollout gives observation tokens), so a
masked term that leaked would move the loss.
"""

import pytest
import torch

import longstraw as ls
from longstraw.engine import grpo as G
from tests.reference import (
    FLOAT64,
    assert_grads_close,
    assert_loss_close,
    compare_step,
    float64_throughout,
    float64_norms,
    grads_of,
    hf_cached_logprobs,
    hf_full_logprobs,
    masked_group,
    reference_grpo_loss,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
)

KL = ls.GRPOConfig(beta=0.05)


def _off_policy(model, group, seed=0):
    """Give `group` old and ref log-probs near the model's (0.0 at masked tokens)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logps = [hf_cached_logprobs(model, group.prompt, r) for r in group.responses]
    noisy = [[lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in logps] for _ in range(2)]
    masks = group.loss_masks or [torch.ones_like(r, dtype=torch.bool) for r in group.responses]
    group.old_logprobs, group.ref_logprobs = ([torch.where(m, lp, 0.0) for lp, m in zip(lps, masks)] for lps in noisy)
    return group


def _dense():
    return float64_norms(tiny_model("qwen3"))


def _group(model, lens=(5, 1, 7, 4), seed=1):
    group = _off_policy(model, masked_group(97, 14, list(lens), seed=seed), seed)
    group.loss_masks[-1] = torch.zeros(lens[-1], dtype=torch.bool)  # all False: allowed, contributes nothing
    return group


# ----------------------------------------------------------------------------
# the loss and every .grad against HF


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("exec_kw", [
    dict(mode="detached"),
    dict(mode="exact"),
    dict(mode="detached", branch_chunk_size=2),  # branch pieces: a piece may hold only masked tokens
    dict(mode="exact", branch_chunk_size=3),
    dict(mode="detached", state_device="cpu"),   # offloaded state
    dict(mode="exact", state_device="cpu"),
], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_dense_masked_step_matches_hf(exec_kw, loss_type):
    model = _dense()
    group = _group(model)
    reference = hf_cached_logprobs if exec_kw["mode"] == "detached" else hf_full_logprobs
    grpo = ls.GRPOConfig(loss_type=loss_type, beta=0.05)
    result = compare_step(model, group, ls.ExecConfig(chunk_size=5, **exec_kw), reference, 1e-9, grpo=grpo)
    assert result.metrics["response_tokens"] == sum(int(m.sum()) for m in group.loss_masks)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_hybrid_masked_step_matches_hf(mode):
    model = tiny_hybrid("qwen3_5")
    group = _group(model, lens=(6, 1, 5), seed=2)
    reference = hf_cached_logprobs if mode == "detached" else hf_full_logprobs
    with float64_throughout(model):  # the GDN gate's float32 A_log cast too: FLOAT64 in both modes
        compare_step(model, group, ls.ExecConfig(chunk_size=5, mode=mode), reference, FLOAT64, grpo=KL)


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_glm_sparse_masked_step_matches_hf(mode):
    model = tiny_mla("glm_moe_dsa")  # index_topk 8 < P: sparse DSA selection
    assert model.config.index_topk < 20
    with float64_throughout(model):  # HF's float32 router and norms cast too
        group = _off_policy(model, masked_group(97, 20, [5, 1, 7], seed=3), 3)
        reference = hf_cached_logprobs if mode == "detached" else hf_full_logprobs
        compare_step(model, group, ls.ExecConfig(chunk_size=6, mode=mode), reference, FLOAT64, grpo=KL)


# ----------------------------------------------------------------------------
# equalities and counts


def _step(model, group, grpo=KL, **exec_kw):
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, ls.ExecConfig(chunk_size=5, **exec_kw)).step(group, grpo)
    return result, grads_of(model)


def _assert_same(a, b):
    (ra, ga), (rb, gb) = a, b
    assert ra.loss == rb.loss
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
    for key in ("response_tokens", "ratio_mean", "clip_fraction", "kl_mean"):
        assert ra.metrics[key] == rb.metrics[key], key


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_all_true_masks_equal_no_masks_exactly(mode):
    model = _dense()
    group = _off_policy(model, masked_group(97, 14, [5, 1, 7], seed=4), 4)
    group.loss_masks = None
    unmasked = _step(model, group, mode=mode)
    group.loss_masks = [torch.ones_like(r, dtype=torch.bool) for r in group.responses]
    _assert_same(_step(model, group, mode=mode), unmasked)


def test_advantages_as_given_equal_rewards_giving_them():
    model = _dense()
    group = _group(model)
    from_rewards = _step(model, group)
    given = ls.Group(prompt=group.prompt, responses=group.responses, rewards=None, old_logprobs=group.old_logprobs,
                     ref_logprobs=group.ref_logprobs, loss_masks=group.loss_masks,
                     advantages=G.advantages(group.rewards, KL).float())  # any float dtype
    got = _step(model, given)
    assert abs(got[0].loss - from_rewards[0].loss) <= 1e-6 * abs(from_rewards[0].loss)  # float32 advantages
    given.advantages = G.advantages(group.rewards, KL)
    _assert_same(_step(model, given), from_rewards)
    assert "reward_mean" not in got[0].metrics and got[0].metrics["advantage_max"] > 0


def test_advantages_are_used_as_given():
    """Advantages no rewards could give (not zero-mean), against the reference loss."""
    model = _dense()
    group = _group(model)
    group.advantages = torch.tensor([1.5, -0.25, 0.75, 2.0], dtype=torch.float64)
    compare_step(model, group, ls.ExecConfig(chunk_size=5), hf_cached_logprobs, 1e-9, grpo=KL)


def test_score_ignores_the_masks():
    model = _dense()
    group = _group(model)
    masked = ls.Engine(model).score(group)
    group.loss_masks = None
    assert all(torch.equal(a, b) for a, b in zip(masked, ls.Engine(model).score(group)))


def test_metrics_count_only_loss_tokens():
    """Old log-probs far off at the masked tokens only: their ratios would be clipped,
    but they are counted in no statistic."""
    model = _dense()
    group = _group(model)
    with torch.no_grad():
        logps = [hf_cached_logprobs(model, group.prompt, r) for r in group.responses]
    group.old_logprobs = [torch.where(m, lp, lp - 5.0) for lp, m in zip(logps, group.loss_masks)]
    result, _ = _step(model, group, ls.GRPOConfig())
    assert result.metrics["clip_fraction"] == 0.0
    assert abs(result.metrics["ratio_mean"] - 1.0) < 1e-12
    assert result.metrics["response_tokens"] == group.loss_tokens < group.response_tokens


def test_batch_totals_count_loss_tokens_and_sum_to_the_batch_loss():
    model = _dense()
    groups = [_group(model, seed=5), _group(model, lens=(3, 6, 2), seed=6)]
    totals = ls.BatchTotals.of(groups)
    assert totals.num_tokens == sum(int(m.sum()) for g in groups for m in g.loss_masks)
    assert totals.max_response_tokens == 7  # a length bound (TRL's max_completion_length): masked tokens too
    for loss_type in ("dapo", "grpo"):
        grpo = ls.GRPOConfig(loss_type=loss_type, beta=0.05)
        model.zero_grad(set_to_none=True)
        engine = ls.Engine(model, ls.ExecConfig(chunk_size=5))
        loss = sum(engine.step(g, grpo, totals=totals).loss for g in groups)
        got = grads_of(model)
        # one batch: every group's responses after one prompt each, one TRL loss over all of them
        model.zero_grad(set_to_none=True)
        want = sum(reference_grpo_loss([hf_cached_logprobs(model, g.prompt, r) for r in g.responses], g,
                                       loss_type=loss_type, beta=0.05, num_sequences=totals.num_sequences,
                                       num_tokens=totals.num_tokens) for g in groups)
        want.backward()
        assert_loss_close(loss, float(want.detach()), 1e-9)
        assert_grads_close(got, grads_of(model), 1e-9)


def test_a_group_without_loss_tokens_is_skipped_before_any_work(monkeypatch):
    """Every mask all False: nothing to learn (TRL would add 0 to the loss). The step
    returns loss 0 without capturing, and .grad is untouched."""
    model = _dense()
    group = _group(model)
    group.loss_masks = [torch.zeros_like(m) for m in group.loss_masks]
    engine = ls.Engine(model)
    monkeypatch.setattr(engine, "capture", lambda *a, **k: pytest.fail("captured a group without loss tokens"))
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    result = engine.step(group, KL)
    assert result.loss == 0.0 and result.metrics["skipped_no_loss_tokens"] == 1.0
    assert result.metrics["skipped_zero_advantage"] == 0.0
    assert all(torch.all(p.grad == 7.0) for p in model.parameters())
    assert ls.BatchTotals.of([group]).num_tokens == 1  # TRL's clamp(min=1)
