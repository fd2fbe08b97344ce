"""Planner validation: the capacity planner's predicted peak for the tiny
families at P = 4K, 16K and 64K against the peak measured on this machine.

    .venv/bin/python bench/validate_planner.py --run   # measure (about an hour on 2 cores), then compare
    .venv/bin/python bench/validate_planner.py         # compare the committed runs with today's planner
    .venv/bin/python bench/validate_planner.py --gpu   # the same for the H200 run (gpu_qwen36_stack.json)

Measurement (`bench/bench_step.py`, one fresh process per run): one GRPO step, G = 2,
R = 128, fp32, after a warm-up step at P = 512 (`--warmup`: code pages and one-time
buffers land in the baseline; its gradients are dropped), with glibc told to return freed
memory at once (MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0
MALLOC_ARENA_MAX=1), so the peak RSS above the loaded model is the program's memory and
not the allocator's retention (without these, RSS sits 43-200 MiB above live tensors;
docs/results.md). `--live-peak` adds the peak of live torch tensors (profiler), the CPU
analogue of `torch.cuda.max_memory_allocated`.

Prediction: `longstraw.plan.estimate` for the same step (fp32, the run's chunk sizes,
`grads_during_capture=False`: one group from zero gradients), minus the weights (loaded
before the baseline) and the optimizer state (no optimizer runs). It is recomputed here
with today's planner, so the CSV always states what the committed planner predicts.

Writes bench/results/planner_validation.csv and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
from bench_step import plan_run  # noqa: E402  (torch-free)

RUNS = os.path.join(HERE, "results", "planner_runs_malloc.csv")
OUT = os.path.join(HERE, "results", "planner_validation.csv")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "1"}
FAMILIES = ("qwen3", "qwen3_5", "glm_moe_dsa")
PROMPTS = (4096, 16384, 65536)
TOLERANCE = 0.15
MIB = 2**20


def run_sweep(families, modes, repeat: int) -> None:
    """Append fresh measurements to RUNS (bench_step.py does the waiting and the isolation)."""
    env = {**os.environ, **MALLOC_ENV}
    for mode in modes:
        for fam in families:
            if mode == "exact" and fam == "glm_moe_dsa":
                continue  # exact mode over 64K DSA positions takes > 15 min on 2 cores; detached only
            cmd = [sys.executable, os.path.join(HERE, "bench_step.py"), "--family", fam, "--methods", mode,
                   "--prompt-tokens", *map(str, PROMPTS), "--groups", "2", "--response-tokens", "128",
                   "--repeat", str(repeat if mode == "detached" else 1), "--live-peak", "--warmup",
                   "--tag", "planner-malloc", "--out", RUNS, "--max-time-s", "1500"]
            subprocess.run(cmd, env=env, check=True)


def predict(row: dict) -> dict:
    """The planner's figures for one measured row (what the process holds above the model)."""
    opt = lambda k: int(row[k]) if row.get(k) else None  # noqa: E731
    kw = {"chunk_size": int(row["chunk_size"]), "attention_block_size": int(row["attention_block_size"]),
          "logits_chunk_size": int(row["logits_chunk_size"]), "branch_chunk_size": opt("branch_chunk_size")}
    r, held = plan_run(row["family"], row["method"], int(row["P"]), int(row["G"]), int(row["R"]), kw,
                       first_group=True)
    return {"planner_bytes": held, "planner_phase": r["peak_phase"], "planner_state_bytes": r["state_bytes_per_rank"],
            "planner_grad_bytes": r["grad_bytes"], "planner_params": r["num_parameters"]}


def compare(rows: list[dict]) -> list[dict]:
    """One row per (family, mode, P): median measured peaks against the prediction."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("warmup") == "True" and r.get("malloc_env"):
            groups.setdefault((r["family"], r["method"], int(r["P"])), []).append(r)
    order = {f: i for i, f in enumerate(FAMILIES)}
    out = []
    for (fam, mode, P), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 9), kv[0][2])):
        rss = statistics.median(float(r["peak_above_model"]) for r in rs)
        lives = [float(r["live_tensor_peak"]) for r in rs if r.get("live_tensor_peak")]
        live = statistics.median(lives) if lives else None
        p = predict(rs[0])
        row = {"family": fam, "mode": mode, "P": P, "G": rs[0]["G"], "R": rs[0]["R"], "runs": len(rs),
               "rss_peak_above_model": int(rss), "live_tensor_peak": None if live is None else int(live),
               **p, "planner_over_rss": p["planner_bytes"] / rss,
               "planner_over_live": None if live is None else p["planner_bytes"] / live,
               "measured_state_bytes": rs[0]["state_bytes"], "chunk_size": rs[0]["chunk_size"],
               "malloc_env": rs[0]["malloc_env"], "git_rev": rs[0]["git_rev"]}
        row["within_15pct_rss"] = abs(row["planner_over_rss"] - 1) <= TOLERANCE
        row["within_15pct_live"] = None if live is None else abs(row["planner_over_live"] - 1) <= TOLERANCE
        out.append(row)
    return out


def markdown(out: list[dict]) -> str:
    head = ["family", "mode", "P", "measured: peak RSS above model", "live tensors", "planner",
            "planner / RSS", "planner / live", "peak phase (planner)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in out:
        live = "–" if r["live_tensor_peak"] is None else f"{r['live_tensor_peak'] / MIB:.1f} MiB"
        ratio_live = "–" if r["planner_over_live"] is None else f"{r['planner_over_live']:.2f}"
        lines.append(f"| {r['family']} | {r['mode']} | {r['P']:,} | {r['rss_peak_above_model'] / MIB:.1f} MiB "
                     f"| {live} | {r['planner_bytes'] / MIB:.1f} MiB | {r['planner_over_rss']:.2f} | {ratio_live} "
                     f"| {r['planner_phase']} |")
    worst = max(abs(r["planner_over_rss"] - 1) for r in out)
    lines.append(f"\nLargest deviation from the measured RSS peak: {worst:.1%} (target <= {TOLERANCE:.0%}).")
    return "\n".join(lines)


def compare_gpu() -> str:
    """The H200 run of bench/gpu/stack.py (bf16, one group from zero gradients, no
    optimizer) against today's planner for the same step, as a Markdown table."""
    import json

    from longstraw.plan import PlanConfig, estimate

    with open(os.path.join(HERE, "results", "gpu_qwen36_stack.json")) as f:
        run = json.load(f)
    model = os.path.join(HERE, "results", "gpu_qwen36_stack_config.json")
    lines = ["| P | measured CUDA peak | planner − optimizer | planner / measured | peak phase |", "|---|---|---|---|---|"]
    for row in run["rows"]:
        r = estimate(model, PlanConfig(prompt_tokens=row["prompt_tokens"], group=row["group"],
                                       response_tokens=row["response_tokens"], chunk_size=8192, dtype="bf16",
                                       gdn_kernel="torch", grads_during_capture=False))
        pred = r["peak_bytes_per_rank"] - r["optimizer_bytes"]
        lines.append(f"| {row['prompt_tokens']:,} | {row['peak_bytes'] / 2**30:.2f} GiB | {pred / 2**30:.2f} GiB "
                     f"| {pred / row['peak_bytes']:.3f} | {r['peak_phase']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", action="store_true", help="measure first (appends to bench/results/"
                                                       "planner_runs_malloc.csv)")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--modes", nargs="+", default=["detached", "exact"], choices=["detached", "exact"])
    ap.add_argument("--repeat", type=int, default=2, help="runs per detached point (exact: 1)")
    ap.add_argument("--gpu", action="store_true", help="compare the committed H200 run instead")
    args = ap.parse_args(argv)
    if args.gpu:
        print(compare_gpu())
        return 0
    if args.run:
        run_sweep(args.families, args.modes, args.repeat)
    with open(RUNS, newline="") as f:
        out = compare(list(csv.DictReader(f)))
    if not out:
        print(f"no warm-up + MALLOC_* runs in {RUNS}; run with --run", file=sys.stderr)
        return 1
    with open(OUT, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    print(markdown(out))
    print(f"\nwrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
