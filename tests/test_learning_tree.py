"""bench/learning's "tree" arm: TreeRL-style tree rollouts on the agent task."""

import pytest
import torch

import longstraw as ls
from bench.learning import tree as T
from bench.learning.arms import LearningConfig, run

from .test_train import AGENT


def test_tree_advantages_are_global_plus_fork_level_by_hand():
    """Two forks of 2: rewards (1, 0 | 1, 1). Root mean 0.75, std sqrt(0.25) = 0.5;
    fork means 0.5 and 1. Leaf 0: (0.25 + 0.5) / 0.5 = 1.5; leaf 1: (-0.75 - 0.5) / 0.5 = -2.5;
    leaves 2, 3: (0.25 + 0) / 0.5 = 0.5 (up to the 1e-4 in the divisor)."""
    adv = T.tree_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv * (0.5 + 1e-4) / 0.5, torch.tensor([1.5, -2.5, 0.5, 0.5], dtype=torch.float64))


def test_the_tree_arm_forks_after_the_observation_and_steps_with_one_capture(tmp_path, monkeypatch):
    """Per prompt: TREE_ROOTS root episodes, each forked into group_size / TREE_ROOTS leaves that
    start with its turn 1 + observation (or are its copies when it made no tool call); the
    update steps on all leaves with the given advantages, on the root's state (one capture
    per prompt for rollouts and update together, beside the KL's and the evaluations')."""
    groups, captures, roots = [], [], []
    real_step, real_capture, real_generate = ls.Engine.step, ls.Engine.capture, ls.Engine.generate

    def step(self, group, grpo, **kw):
        groups.append(group)
        assert kw["state"] is not None
        return real_step(self, group, grpo, **kw)

    def capture(self, prompt, **kw):
        captures.append(self)
        return real_capture(self, prompt, **kw)

    def generate(self, prompt, *args, **kw):
        out = real_generate(self, prompt, *args, **kw)
        if kw.get("prefix") is None and kw.get("num_samples") == T.TREE_ROOTS:
            roots.append(out)  # a root sample (forks pass a prefix; evaluations sample 1, greedy)
        return out

    monkeypatch.setattr(ls.Engine, "step", step)
    monkeypatch.setattr(ls.Engine, "capture", capture)
    monkeypatch.setattr(ls.Engine, "generate", generate)
    cfg = LearningConfig(**{**AGENT, "group_size": 8, "log_kl": False}, arm="tree", steps=2, eval_every=2,
                         out_dir=str(tmp_path / "run"))
    run(cfg)
    assert len(groups) == 2 * 2 and len(roots) == len(groups)
    k = cfg.group_size // T.TREE_ROOTS
    for g, root in zip(groups, roots):
        assert g.size == cfg.group_size and g.advantages is not None
        for f in range(T.TREE_ROOTS):
            fork, episode = g.responses[f * k:(f + 1) * k], root.responses[f]
            # the root's own record: an episode that made no tool call (or is shorter than the fork
            # point) stands for its fork as k copies; every other one is forked at turn 2
            if root.turns[f] == 0 or episode.numel() < T.TURN2:
                assert all(torch.equal(r, episode) for r in fork)
            else:
                assert all(torch.equal(r[:T.TURN2], episode[:T.TURN2]) for r in fork)
        forks = torch.arange(T.TREE_ROOTS).repeat_interleave(k)
        torch.testing.assert_close(g.advantages, T.tree_advantages(g.rewards, forks))
    assert len(captures) == 2 * 2 + 2 * 4  # 2 steps x 2 prompts (forks and update reuse it); 2 evaluations x 4


def test_a_group_size_the_roots_do_not_divide_is_refused_at_config_time():
    with pytest.raises(ValueError, match="multiple of 4, got 6"):
        LearningConfig(**{**AGENT, "group_size": 6}, arm="tree")
    LearningConfig(**{**AGENT, "group_size": 6}, arm="detached")  # only the tree arm forks
