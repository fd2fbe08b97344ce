"""Held-out evaluation of the learning runs' start and end points, beyond the loop's
greedy accuracy: the mean reward of G samples at the training temperature (the policy
RL actually optimises), on the same held-out prompts, for the warm start and for each
run's final checkpoint.

    python bench/learning_eval.py bench/results/learning/dense-exact-s0 [more run dirs] [--prompts 32]
    # greedy only, on 128 held-out items the loop's own evaluation (items 0-31) never saw:
    python bench/learning_eval.py RUNS --first 32 --prompts 128 --greedy-only --out-name eval_fresh.json

One capture per prompt serves all G samples (engine.generate). Writes
<run>/eval_sampled.json (or --out-name) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import longstraw as ls  # noqa: E402
from bench.learning.arms import LearningConfig as TrainConfig  # noqa: E402  (the hybrid preset too)
from longstraw.train import episode_kwargs, warm_model  # noqa: E402
from longstraw.train_budget import TRAIN_CHUNK_SIZE  # noqa: E402


def sampled_eval(model, cfg: TrainConfig, n: int, first: int = 0, sampled: bool = True) -> dict:
    """Held-out items first .. first+n-1: greedy accuracy, and (when `sampled`) the mean
    reward of G samples at the training temperature."""
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=cfg.chunk_size or TRAIN_CHUNK_SIZE))
    task = cfg.task()
    rewards, greedy = [], []
    for i in range(first, first + n):
        item = task.item("heldout", i)
        kw = episode_kwargs(task, item)  # the agent task: its tool as the environment
        if sampled:
            ro = engine.generate(item.prompt, num_samples=cfg.group_size, temperature=cfg.temperature,
                                 generator=torch.Generator().manual_seed(10_000 + i), **kw)
            rewards += [task.reward(item, r) for r in ro.responses]
        g = engine.generate(item.prompt, num_samples=1, temperature=0.0, **kw).responses[0]
        greedy.append(task.reward(item, g) == 1.0)  # exact match
    return {"sampled_reward": sum(rewards) / len(rewards) if rewards else None, "greedy_accuracy": sum(greedy) / n,
            "first_item": first, "prompts": n, "samples_per_prompt": cfg.group_size, "temperature": cfg.temperature}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--first", type=int, default=0,
                    help="first held-out item (e.g. 32: items the loop's own evaluation never saw)")
    ap.add_argument("--greedy-only", action="store_true", help="skip the sampled reward (half the captures)")
    ap.add_argument("--out-name", default="eval_sampled.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out, warm_done = [], {}
    for run in args.runs:
        with open(os.path.join(run, "config.json")) as f:
            cfg = TrainConfig(**json.load(f))
        key = (cfg.model, cfg.model_seed, cfg.prompt_tokens)
        if key not in warm_done:
            model, _ = warm_model(cfg)
            warm_done[key] = sampled_eval(model, cfg, args.prompts, args.first, not args.greedy_only)
        model, _ = warm_model(cfg)
        ckpt = torch.load(os.path.join(run, "checkpoint.pt"), weights_only=False)
        model.load_state_dict(ckpt["model"])
        row = {"run": run, "step": ckpt["step"], "warm_start": warm_done[key],
               "final": sampled_eval(model, cfg, args.prompts, args.first, not args.greedy_only)}
        with open(os.path.join(run, args.out_name), "w") as f:
            json.dump(row, f, indent=1)
        if not args.greedy_only:
            print(f"{run}: sampled reward (T={cfg.temperature}) {row['warm_start']['sampled_reward']:.3f} -> "
                  f"{row['final']['sampled_reward']:.3f}", flush=True)
        print(f"{run}: greedy {row['warm_start']['greedy_accuracy']:.3f} -> "
              f"{row['final']['greedy_accuracy']:.3f} (step {row['step']})", flush=True)
        out.append(row)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
