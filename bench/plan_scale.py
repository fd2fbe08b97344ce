"""How many GPUs, and how long a step: Qwen3.6-27B (NF4 QLoRA rank 16) and GLM-5.2 (LoRA rank
8) at 1M, 2M, 4.46M and 10M prompt tokens (G = 8 responses of 8,192 tokens), on H20 and on
H200, planned (no GPU needed: `longstraw.plan`, `--fit`).

For each (model, P, GPU, mode) the smallest power-of-two GPU count from 8 up (1 for a
single H200 at 1M) for which `plan/fit.search` finds a configuration whose peak fits 85%
of the GPU's memory (the reserve is the other 15%), with that configuration's flags,
peak and time (compute + communication, `plan/comm.py`, at the preset's stated
efficiency). These are the planner's estimates, with its assumptions (docs/planner.md);
the H20 efficiency is calibrated on the paper's capture, and the same share of peak is
assumed on the H200.

Usage: python bench/plan_scale.py [--out bench/results/planned/scale.json]   (one JSON line at the end)
"""

from __future__ import annotations

import argparse
import json
import os

from longstraw.plan import PlanConfig, parse_bytes
from longstraw.plan.fit import Fit, flags, search
from longstraw.plan.gpus import gpu_spec

MODELS = {"qwen3.6-27b": dict(lora_rank=16, weight_dtype="nf4", gdn_kernel="fla"), "glm-5.2": dict(lora_rank=8)}
"""The paper's training setups (QLoRA 16 on NF4; LoRA 8); on these GPUs the GDN kernel is flash-linear-attention."""
PROMPTS = {"1M": 1_048_576, "2M": 2_088_960, "4.46M": 4_448_256, "10M": 10_485_760}
GPUS = ("h20", "h200")


def fit_at(model: str, P: int, gpu: str, mode: str, kw: dict, w: int) -> dict | None:
    """The fit on `w` GPUs (85% of memory), or None."""
    reserve = int(0.15 * parse_bytes(gpu_spec(gpu).memory))
    cfg = PlanConfig(prompt_tokens=P, group=8, response_tokens=8192, gpus=w, gpu=gpu, reserve=reserve, mode=mode,
                     **kw)
    r = search(model, cfg, pinned={"mode"})
    if not isinstance(r, Fit):
        return None
    return {"gpus": w, "flags": flags(r.config), "peak_gib": r.report["peak_bytes_per_rank"] / 2**30,
            "time_s": r.report["estimated_time_s"], "comm_s": r.report["comm"]["comm_s"]}


def smallest_fit(model: str, P: int, gpu: str, mode: str, kw: dict) -> dict:
    """The smallest GPU count (powers of two) that fits, and its fit; and the fit on one
    8-GPU node (Qwen) or 4 nodes (GLM-5.2), the paper's counts, when that fits."""
    node = 8 if model.startswith("qwen") else 32
    at_node = fit_at(model, P, gpu, mode, kw, node)
    w = 1
    while w <= 4096:
        r = fit_at(model, P, gpu, mode, kw, w) if w != node else at_node
        if r is not None:
            return {**r, "at_paper_gpus": at_node}
        w *= 2
    return {"gpus": None, "at_paper_gpus": at_node}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "planned",
                                                  "scale.json"))
    ap.add_argument("--modes", nargs="+", default=["detached", "exact"])
    a = ap.parse_args()
    rows = []
    for model, kw in MODELS.items():
        for name, P in PROMPTS.items():
            for gpu in GPUS:
                for mode in a.modes:
                    row = {"model": model, "P": name, "prompt_tokens": P, "gpu": gpu, "mode": mode,
                           **smallest_fit(model, P, gpu, mode, kw)}
                    rows.append(row)
                    t = f"{row['time_s']:,.0f} s" if row["gpus"] else "-"
                    n = row["at_paper_gpus"]
                    at = f"{n['gpus']} GPUs {n['time_s']:,.0f} s" if n else "does not fit"
                    print(f"{model:12s} P={name:6s} {gpu:5s} {mode:8s} GPUs {row['gpus']}  time {t}  "
                          + " ".join(row.get("flags", [])) + f"  | paper's count: {at}", flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(json.dumps({"bench": "plan_scale", "rows": len(rows), "out": a.out}))


if __name__ == "__main__":
    main()
