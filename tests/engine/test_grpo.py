"""GRPO pieces: advantages and branch weights, against the formulas."""

import torch

import longstraw as ls
from longstraw.engine import grpo as G


def test_group_advantages_use_unbiased_std_plus_eps():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    adv = G.advantages(r, ls.GRPOConfig())
    expected = (r - r.mean()) / (torch.std(r, unbiased=True) + 1e-4)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(G.advantages(r, ls.GRPOConfig(scale_rewards="none")), r - r.mean())


def test_single_response_group_has_zero_advantage():
    assert float(G.advantages(torch.tensor([3.0]), ls.GRPOConfig())) == 0.0


def test_branch_weights_sum_to_the_loss_normaliser():
    totals = ls.BatchTotals(num_sequences=4, num_tokens=20, max_response_tokens=9)
    assert G.branch_weight(ls.GRPOConfig(loss_type="dapo"), totals, 5) == 1 / 20
    assert G.branch_weight(ls.GRPOConfig(loss_type="grpo"), totals, 5) == 1 / 20
    assert G.branch_weight(ls.GRPOConfig(loss_type="dr_grpo"), totals, 5) == 1 / 36
    cfg = ls.GRPOConfig(loss_type="dr_grpo", max_completion_length=16)
    assert G.branch_weight(cfg, totals, 5) == 1 / 64


def test_clip_and_kl_match_trl_formula():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    old = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.2, -1.8, -0.4], dtype=torch.float64)
    cfg = ls.GRPOConfig(epsilon_low=0.2, epsilon_high=0.28, beta=0.1)
    for adv in (1.0, -1.0):
        loss, stats = G.per_token_loss(logp, old, adv, cfg, ref)
        ratio = torch.exp(logp - old)
        want = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.28) * adv)
        want = want + 0.1 * (torch.exp(ref - logp) - (ref - logp) - 1)
        torch.testing.assert_close(loss, want)
    assert stats["clipped"].tolist() == [False, True, False]  # adv<0, ratio<0.8 on token 1
