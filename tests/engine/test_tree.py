"""Prefix trees (`ExecConfig(share_response_prefixes=True)`, `engine/tree.py`): `step`
and `score` on groups whose responses share leading tokens equal the flat path
(`share_response_prefixes=False`) and HF's reference (the cached continuation for
detached mode, the full prompt + response forward for exact mode), float64.

Tolerances, and why:
* dense (qwen3, float64 norms): 1e-9 on the loss and every .grad, against both.
* qwen3_5 (float64 norms and gated norms): 1e-5. The GDN decay casts to float32 as HF
  does (`A_log.float()`, `a.float() + dt_bias`), so the gradient reaching `a` (and from
  there every earlier layer) is rounded to float32 once per backward call, and a tree
  sums a shared token's members before that rounding where the flat path rounds each
  (as exact mode and branch pieces do: tests/models/test_hybrid.py); A_log's gradient,
  a float32 sum over tokens that partly cancel, then differs by up to ~2e-6 relative.
  With the decay in float64 on both engine paths, tree and flat agree to 1e-9 on every
  tree (`test_hybrid_tree_equals_flat_with_a_float64_decay`).
* glm_moe_dsa (float64 norms): 1e-6. Its MoE router computes in float32, and float32
  matmuls round by the shape of the batch, which a tree changes (tests/models/test_mla.py).
"""

import contextlib
from collections import Counter

import pytest
import torch

import longstraw as ls
from longstraw.engine.trie import build_trie
from longstraw.errors import ConfigError
from longstraw.phase import Phase
from tests.reference import (
    TREE_LENGTHS,
    assert_grads_close,
    assert_loss_close,
    float64_hybrid,
    float64_hybrid_norms,
    float64_norms,
    grads_of,
    hf_cached_logprobs,
    hf_full_logprobs,
    reference_grpo_loss,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
    tree_group,
)

TREES = {
    "two_levels": ["AB", "AC"],                      # P -> A -> {B, C}
    "three_levels": ["ABD", "ABE", "ACF", "ACH", "AC"],  # and a response that ends at a fork
    "fork_at_token_1": ["aB", "aC"],
    "fork_at_last_token": ["Ab", "Ac"],
    "identical": ["AB", "AB", "AB", "C"],           # (all alike would give a zero gradient)
    "longer_than_chunk": ["LB", "LC", "L"],          # an 11-token segment in chunks of 4
    "G_1": ["AB"],
    "nothing_shared": ["B", "C", "D"],
}
CHUNK = 4

TOLERANCE = {"qwen3": 1e-9, "qwen3_5": 1e-5, "glm_moe_dsa": 1e-6}


def _model(family):
    if family == "qwen3_5":
        return float64_hybrid_norms(tiny_hybrid(family))
    if family == "glm_moe_dsa":
        return float64_norms(tiny_mla(family, index_topk=6))  # index_topk < P: sparse DSA selection
    return float64_norms(tiny_model(family))


def _assert_close(family, got, want, loss_got, loss_want):
    assert_loss_close(loss_got, loss_want, TOLERANCE[family])
    assert_grads_close(got, want, TOLERANCE[family])


def _step(model, group, grpo, **exec_kw):
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, ls.ExecConfig(chunk_size=CHUNK, **exec_kw)).step(group, grpo)
    return result, grads_of(model)


def _reference(model, group, grpo, mode):
    model.zero_grad(set_to_none=True)
    reference = hf_cached_logprobs if mode == "detached" else hf_full_logprobs
    logps = [reference(model, group.prompt, r) for r in group.responses]
    loss = reference_grpo_loss(logps, group, loss_type=grpo.loss_type, beta=grpo.beta)
    loss.backward()
    return float(loss.detach()), grads_of(model)


def check_tree(family, group, mode, grpo=None, **exec_kw):
    """step (tree) == step (flat) == HF's reference; score (tree) == score (flat)."""
    grpo = ls.GRPOConfig(loss_type="grpo") if grpo is None else grpo
    model = _model(family)
    tree, tree_grads = _step(model, group, grpo, mode=mode, **exec_kw)
    flat, flat_grads = _step(model, group, grpo, mode=mode, share_response_prefixes=False, **exec_kw)
    _assert_close(family, tree_grads, flat_grads, tree.loss, flat.loss)
    for key in ("response_tokens", "ratio_mean", "clip_fraction"):
        assert abs(tree.metrics[key] - flat.metrics[key]) <= 1e-12 * max(1.0, abs(flat.metrics[key])), key
    scores = ls.Engine(model, ls.ExecConfig(chunk_size=CHUNK)).score(group)
    flat_scores = ls.Engine(model, ls.ExecConfig(chunk_size=CHUNK, share_response_prefixes=False)).score(group)
    for s, f in zip(scores, flat_scores):
        torch.testing.assert_close(s, f, rtol=1e-10 if family != "glm_moe_dsa" else 1e-6, atol=1e-12)  # no grad
    # (float64_hybrid runs HF's GDN kernel in float64, and restores the norms' stock forward on exit)
    with float64_hybrid(model) if family == "qwen3_5" else contextlib.nullcontext():
        loss, want = _reference(model, group, grpo, mode)
    _assert_close(family, tree_grads, want, tree.loss, loss)
    return tree, flat


# ----------------------------------------------------------------------------
# every tree shape, dense, both modes


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("name", list(TREES))
def test_dense_tree_equals_flat_and_hf(name, mode):
    group = tree_group(TREES[name])
    tree, flat = check_tree("qwen3", group, mode)
    root = build_trie(group.responses)
    assert tree.metrics["replay_tokens"] == root.forwarded_tokens() <= flat.metrics["replay_tokens"]
    assert (tree.metrics["shared_segments"] > 0) == (name not in ("G_1", "nothing_shared"))


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("family", ["qwen3_5", "glm_moe_dsa"])
@pytest.mark.parametrize("name", ["three_levels", "fork_at_token_1", "fork_at_last_token", "identical",
                                  "longer_than_chunk", "G_1"])
def test_hybrid_and_mla_tree_equals_flat_and_hf(name, family, mode):
    check_tree(family, tree_group(TREES[name], prompt_len=11), mode)


def _float64_decay(module, a, params=None):
    """The GDN decay of `gated_deltanet._log_decay` in the input dtype (no float32 cast)."""
    a_log, dt_bias = (module.A_log, module.dt_bias) if params is None else params
    return -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("name", list(TREES))
def test_hybrid_tree_equals_flat_with_a_float64_decay(name, mode, monkeypatch):
    from longstraw.models import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "_log_decay", _float64_decay)
    model, group, grpo = _model("qwen3_5"), tree_group(TREES[name], prompt_len=11), ls.GRPOConfig(loss_type="grpo")
    tree, tree_grads = _step(model, group, grpo, mode=mode)
    flat, flat_grads = _step(model, group, grpo, mode=mode, share_response_prefixes=False)
    assert_loss_close(tree.loss, flat.loss, 1e-9)
    assert_grads_close(tree_grads, flat_grads, 1e-9)


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("exec_kw", [dict(branch_chunk_size=2), dict(state_device="cpu")],
                         ids=["branch_pieces", "offload"])
def test_tree_with_branch_pieces_and_offload(exec_kw, mode):
    check_tree("qwen3", tree_group(TREES["three_levels"]), mode, **exec_kw)


# ----------------------------------------------------------------------------
# loss types, off-policy ratios that clip, KL, and masks


def _off_policy(model, group, scale=0.3, seed=0):
    """Old / ref log-probs near the model's, with noise (so the clip binds for some
    tokens), 0.0 where a mask is False. Shared tokens get the same values in every
    response (what a rollout gives), except `group.old_logprobs[0]`, whose noise is its own."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logps = [hf_cached_logprobs(model, group.prompt, r) for r in group.responses]
    masks = group.loss_masks or [torch.ones_like(r, dtype=torch.bool) for r in group.responses]
    noisy = [[lp + scale * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in logps] for _ in range(2)]
    group.old_logprobs, group.ref_logprobs = ([torch.where(m, lp, 0.0) for lp, m in zip(lps, masks)] for lps in noisy)
    return group


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_loss_types_off_policy_with_kl(loss_type, mode):
    group = _off_policy(_model("qwen3"), tree_group(TREES["three_levels"]), scale=0.5)
    tree, _ = check_tree("qwen3", group, mode, grpo=ls.GRPOConfig(loss_type=loss_type, beta=0.05))
    assert 0 < tree.metrics["clip_fraction"] < 1


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_masks_that_differ_inside_a_shared_segment(mode):
    """Responses 0 and 1 hold the same tokens AB, but 0 masks A's tokens 2..3: they
    share A[:2] only. Response 2 (AC, all True) shares A with 1."""
    group = tree_group(["AB", "AB", "AC"])
    masks = [torch.ones_like(r, dtype=torch.bool) for r in group.responses]
    masks[0][2:4] = False
    group.loss_masks = masks
    root = build_trie(group.responses, masks)
    assert (root.start, root.end, root.members) == (0, 2, [0, 1, 2])
    assert [(c.start, c.end, c.members) for c in root.children] == [(2, 8, [0]), (2, 5, [1, 2])]
    group = _off_policy(_model("qwen3"), group)
    check_tree("qwen3", group, mode, grpo=ls.GRPOConfig(loss_type="grpo", beta=0.05))


# ----------------------------------------------------------------------------
# work done once, and the config


def _count_positions(engine, phase: Phase, start: int):
    """Wrap engine.adapter.run: a Counter of absolute positions >= start that phase `phase` ran."""
    seen, run, want = Counter(), engine.adapter.run, phase

    def counting(ids, at, states, *, phase, **kw):
        if Phase(phase) is want and at >= start:
            seen.update(range(at, at + ids.shape[0]))
        return run(ids, at, states, phase=phase, **kw)

    engine.adapter.run = counting
    return seen


@pytest.mark.parametrize("share", [True, False])
def test_a_shared_segment_runs_once(share):
    """Four responses share A (5 tokens), then two share B: with sharing every response
    position is recomputed with autograd exactly once per distinct (prefix, position),
    the shared ones once in all; flat, once per response holding it."""
    group = tree_group(["AB", "AB", "AC", "AD"])
    model = _model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=CHUNK, share_response_prefixes=share))
    p = group.prompt.numel() - 1
    recomputed = _count_positions(engine, Phase.RECOMPUTE, p)
    result = engine.step(group, ls.GRPOConfig())
    a = TREE_LENGTHS["A"]
    if share:  # A once; B once (for 0 and 1); the children of A each once
        assert all(recomputed[p + j] == 1 for j in range(a))
        assert sum(recomputed.values()) == a + TREE_LENGTHS["B"] + TREE_LENGTHS["C"] + TREE_LENGTHS["D"]
    else:
        assert all(recomputed[p + j] == 4 for j in range(a))
        assert sum(recomputed.values()) == group.response_tokens
    assert result.metrics["replay_tokens"] == sum(recomputed.values())


def test_score_runs_a_shared_segment_once():
    group = tree_group(["LB", "LC", "L"])
    engine = ls.Engine(_model("qwen3"), ls.ExecConfig(chunk_size=CHUNK))
    p = group.prompt.numel() - 1
    captured = _count_positions(engine, Phase.CAPTURE, p)
    engine.score(group)
    assert sorted(captured) == list(range(p, p + TREE_LENGTHS["L"])) and set(captured.values()) == {1}


def test_share_response_prefixes_must_be_a_bool():
    with pytest.raises(ConfigError, match="share_response_prefixes"):
        ls.ExecConfig(share_response_prefixes="yes")
    assert ls.ExecConfig().share_response_prefixes is True


def test_the_tree_rollout_recipe_of_docs_trees():
    """docs/trees.md's recipe: G at the root, a fork from each root response with
    `prefix=` and `state=` (no second capture), per-fork advantages, one step on every
    leaf against the root's state: equal to the flat step, and the prefixes shared."""
    model = _model("qwen3")
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=CHUNK))
    prompt = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    root = engine.generate(prompt, num_samples=2, max_new_tokens=6, generator=gen)
    leaves, forks = [], []
    for i, r in enumerate(root.responses):
        more = engine.generate(prompt, num_samples=2, max_new_tokens=6, generator=gen, prefix=r[:3], state=root.state)
        leaves += more.responses
        forks += [i] * len(more.responses)
    rewards = torch.rand(len(leaves), generator=gen, dtype=torch.float64)
    fork = torch.tensor(forks)
    fork_mean = torch.stack([rewards[fork == f].mean() for f in fork.tolist()])
    group = ls.Group(prompt=prompt, responses=leaves, rewards=rewards,
                     advantages=(rewards - rewards.mean()) + (rewards - fork_mean))
    model.zero_grad(set_to_none=True)
    tree = engine.step(group, ls.GRPOConfig(), state=root.state)
    tree_grads = grads_of(model)
    flat, flat_grads = _step(model, group, ls.GRPOConfig(), share_response_prefixes=False)
    assert_loss_close(tree.loss, flat.loss, 1e-9)
    assert_grads_close(tree_grads, flat_grads, 1e-9)
    assert tree.metrics["shared_segments"] >= 2 and tree.metrics["replay_tokens"] < flat.metrics["replay_tokens"]


def test_progress_shows_a_replay_bar_over_the_trees_segments(capsys):
    """progress=True: the tree's replay has one bar counting its segments (A, B, C, D: AB twice is
    one leaf), with no bar per segment's chunks."""
    group = tree_group(["AB", "AB", "AC", "AD"])
    engine = ls.Engine(_model("qwen3"), ls.ExecConfig(chunk_size=CHUNK, progress=True))
    engine.step(group, ls.GRPOConfig())
    err = capsys.readouterr().err
    assert "replay" in err and "/4 [" in err and "/5 [" not in err
    assert err.count("reverse") == 0  # detached: no prompt walk; the segments' walks run inside the replay bar
