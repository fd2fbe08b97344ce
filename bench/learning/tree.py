"""The learning experiment's "tree" arm: TreeRL-style tree rollouts on the agent task.

Per prompt, with G = group_size leaves and `TREE_ROOTS` samples at the root:

    root  = engine.generate(prompt, num_samples=TREE_ROOTS, environment=tool)   # one capture
    fork  = each root episode after the tool's observation (the start of turn 2):
            engine.generate(prompt, num_samples=G // TREE_ROOTS, prefix=episode[:4],
                            prefix_loss_mask=its mask, state=root.state)         # no capture
    step  = engine.step(all G leaves, state=root.state)                          # one capture

A root episode that made no tool call has ended (reward 0) and has no turn 2 to fork:
it stands for its fork with G // TREE_ROOTS identical copies (the trie shares them), so
every fork weighs the same and the group keeps G leaves.

Advantages (`Group.advantages`, one per leaf, as docs/trees.md's recipe):

    A_i = ((r_i - mean_root) + (r_i - mean_fork(i))) / (std_root + 1e-4)

mean_root and std_root over the G leaves, mean_fork over the leaf's fork: the leaf's
global advantage plus its advantage within its fork (TreeRL's G_A + L_A at the leaf),
scaled like GRPO's. So turn 2 is credited twice against its siblings, and a fork whose
first turn went wrong pulls all its leaves down. Everything else (mode detached, loss,
optimizer, eval, budget of G leaves per prompt) is run 4's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from longstraw.group import Group
from longstraw.tasks.episodes import episode_kwargs

TREE_ROOTS = 4
"""Root samples per prompt; each is forked into group_size // TREE_ROOTS leaves."""
TURN2 = 4
"""The fork point: id EOS RESULT answer (turn 1 + the observation), then turn 2."""


def tree_advantages(rewards: torch.Tensor, forks: torch.Tensor) -> torch.Tensor:
    """[G] float64 advantages from [G] rewards and [G] fork ids (see the module docstring)."""
    fork_mean = torch.stack([rewards[forks == f].mean() for f in forks.tolist()])  # (G,)
    std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return ((rewards - rewards.mean()) + (rewards - fork_mean)) / (std + 1e-4)


def _fork(run, item, ro, i: int, k: int, gen) -> tuple[list, list, list]:
    """k leaves of root episode i: forked after its observation, or k copies if it has none."""
    r, lp, mask = ro.responses[i], ro.logprobs[i], ro.loss_masks[i]
    if ro.turns[i] == 0 or r.numel() < TURN2:
        return [r] * k, [lp] * k, [mask] * k
    kw = episode_kwargs(run.task, item)
    more = run.engine.generate(item.prompt, num_samples=k, max_new_tokens=kw["max_new_tokens"],
                               eos_token_id=kw["eos_token_id"], temperature=run.cfg.temperature, generator=gen,
                               prefix=r[:TURN2], prefix_loss_mask=mask[:TURN2], state=ro.state)
    return more.responses, more.logprobs, more.loss_masks


def tree_rollouts(run, step: int, gen: torch.Generator) -> tuple[list, list]:
    """`train(rollouts=)` for the tree arm: per prompt, a two-level tree of group_size leaves."""
    cfg = run.cfg
    k = cfg.group_size // TREE_ROOTS
    items = [run.task.item("train", step * cfg.prompts_per_step + b) for b in range(cfg.prompts_per_step)]
    rollouts, groups = [], []
    for item in items:
        ro = run.engine.generate(item.prompt, num_samples=TREE_ROOTS, temperature=cfg.temperature, top_p=1.0,
                                 top_k=0, generator=gen, **episode_kwargs(run.task, item))
        leaves, logps, masks, forks = [], [], [], []
        for i in range(TREE_ROOTS):
            resp, lp, m = _fork(run, item, ro, i, k, gen)
            leaves += resp
            logps += lp
            masks += m
            forks += [i] * k
        rewards = torch.tensor([run.task.reward(item, r) for r in leaves], dtype=torch.float64)
        adv = tree_advantages(rewards, torch.tensor(forks))
        rollouts.append(replace(ro, responses=leaves, logprobs=logps, loss_masks=masks))
        groups.append(Group(prompt=item.prompt, responses=leaves, rewards=rewards, advantages=adv,
                            old_logprobs=logps, loss_masks=masks))
    return rollouts, groups
