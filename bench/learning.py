"""The learning experiment: GRPO at long P with three arms, from one warm start.

    python bench/learning.py --config bench/learning/dense.json --arms exact detached full --seeds 0

Each (arm, seed) is one `longstraw.train.train` run (`bench/learning/arms.run`: the full
arm is this harness's) writing
bench/results/learning/<model>-<arm>-s<seed>/log.jsonl; the arms of a seed share the
warm start (cached by its config), the prompts, their order, and the per-step sampling
generator. Runs are sequential (one heavy process at a time) on one thread. Extra
`--set key=value` pairs override config fields (e.g. --set steps=10 for the costly
full-sequence arm). Ends with one JSON line: the before/after held-out accuracy per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.learning.arms import LearningConfig, run  # noqa: E402
from longstraw.train import config_from_args  # noqa: E402


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--arms", nargs="+", default=["exact", "detached", "full"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--out", default="bench/results/learning")
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides")
    args = ap.parse_args()
    overrides = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    summary = []
    for seed in args.seeds:
        for arm in args.arms:
            cfg = config_from_args({**overrides, "arm": arm, "seed": seed}, args.config, LearningConfig)
            cfg.out_dir = os.path.join(args.out, f"{cfg.model}-{arm}-s{seed}")
            t0, c0 = time.perf_counter(), time.process_time()
            run(cfg)
            with open(os.path.join(cfg.out_dir, "log.jsonl")) as f:
                log = [json.loads(line) for line in f]
            key = "heldout_accuracy" if cfg.eval_split == "heldout" else f"eval_{cfg.eval_split}_accuracy"
            evals = [r for r in log if key in r]
            row = {"model": cfg.model, "arm": arm, "seed": seed, "steps": cfg.steps,
                   "heldout_before": evals[0][key], "heldout_after": evals[-1][key],
                   "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
            print(f"{row['model']:>7} {arm:>9} seed {seed}: held-out {row['heldout_before']:.3f} -> "
                  f"{row['heldout_after']:.3f} in {row['steps']} steps, {row['cpu_s']:.0f} CPU s", flush=True)
            summary.append(row)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
