"""A task's episodes through an engine: what `Engine.generate` needs for one item of a
task (its response budget, eos, and for an agent task its tool as the environment), and
the greedy held-out evaluation that `longstraw train` and bench/learning share.

`task` is a `KVRecall` or a `ToolLookup`; `engine` anything with `generate` (an
`Engine`): nothing here imports the engine.
"""

from __future__ import annotations

from .kv_recall import Vocab

TASKS = ("kv_recall", "tool_lookup")
"""The names `longstraw train --task` takes (`TrainConfig.task_name`)."""


def episode_kwargs(task, item) -> dict:
    """`engine.generate`'s keywords for one episode of `task`: its response budget and
    eos, and for the agent task its environment (the tool) and turns."""
    kw = dict(max_new_tokens=task.response_tokens, eos_token_id=Vocab.EOS)
    env = task.environment(item)
    return kw if env is None else dict(kw, environment=env, max_turns=task.max_turns)


def evaluate(engine, task, n: int, *, split: str = "heldout") -> dict:
    """Greedy decoding on n items of `split`: accuracy (exact match) and mean reward.
    Held-out: its first n items. Train (pilots only): items from 10**6 on, which no run
    of under a million prompts trains on."""
    hits, total = 0, 0.0
    first = 0 if split == "heldout" else 10**6
    for i in range(first, first + n):
        item = task.item(split, i)
        r = engine.generate(item.prompt, num_samples=1, temperature=0.0, **episode_kwargs(task, item)).responses[0]
        score = task.reward(item, r)
        hits += score == 1.0  # exact match
        total += score
    pre = "heldout" if split == "heldout" else f"eval_{split}"
    return {f"{pre}_accuracy": hits / n, f"{pre}_reward": total / n, f"{pre}_n": n}
