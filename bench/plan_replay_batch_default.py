"""The planned peak of the default `replay_batch=None` against one branch at a time
(`defaults.replay_batch_for`; issue 46): which b the rule takes, and what it does to the
planned peak, for the tiny models at the cost benchmark's shapes and two presets.

    python bench/plan_replay_batch_default.py   # rows to bench/results/plan_replay_batch_default.csv
"""

from __future__ import annotations

import csv
import os

import torch

from longstraw.plan import PlanConfig, estimate
from longstraw.shapes import planner_config
from longstraw.tiny import tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "bench", "results", "plan_replay_batch_default.csv")


def cases():
    """(model label, planner config, P, R, chunk, dtype) of every row."""
    for family in ("qwen3", "qwen3_5", "glm_moe_dsa"):
        cfg = planner_config(tiny_model(family, dtype=torch.float32))
        for p in (8192, 32768):
            for chunk in (1024, 4096):
                yield f"tiny {family}", cfg, p, 128, chunk, "float32"
    for preset in ("qwen3-8b", "qwen3.6-27b"):
        yield preset, preset, 131072, 1024, 4096, "bfloat16"


def main() -> None:
    rows = []
    for label, cfg, p, r, chunk, dtype in cases():
        plans = {b: estimate(cfg, PlanConfig(prompt_tokens=p, group=8, response_tokens=r, dtype=dtype, mode="exact",
                                             chunk_size=chunk, replay_batch=b)) for b in (1, None)}
        one, rule = plans[1], plans[None]
        rows.append({"model": label, "P": p, "G": 8, "R": r, "chunk_size": chunk, "mode": "exact",
                     "rule_replay_batch": rule["replay_batch"], "walk_recompute_layers": rule["walk_recompute_layers"],
                     "peak_b1": int(one["peak_bytes_per_rank"]), "peak_rule": int(rule["peak_bytes_per_rank"]),
                     "peak_ratio": round(rule["peak_bytes_per_rank"] / one["peak_bytes_per_rank"], 4),
                     "phase_b1": one["peak_phase"], "phase_rule": rule["peak_phase"]})
        print(rows[-1])
    with open(OUT, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"rows to {OUT}")


if __name__ == "__main__":
    main()
