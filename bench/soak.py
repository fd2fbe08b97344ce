"""Soak run: 300 steps of `longstraw train` at P = 4,096 on the tiny dense preset, with the
child's resident set size read after every step.

Why. A training loop that leaks (a prompt state kept alive into the next step, exact
mode's state-gradient buffers kept after `step`, a log held in memory) shows it as RSS
that climbs with the step count. The loop's working set is fixed by P, G and the model,
so after the first steps (allocator warm-up, the first evaluation) RSS should be flat.
The bar (issue 23): RSS at step 300 within 5% of RSS at step 30.

How. The parent starts `python -m longstraw.cli train ...` (the CLI, not the library) and
polls its `log.jsonl`; each time a step's line appears it reads the child's VmRSS from
/proc/PID/status. One row per step: step, rss_bytes, the child's peak (VmHWM), the step's
own time and reward, and whether the update was skipped (zero advantage, non-finite).
Times are noisy on a shared machine; RSS is what this measures.

    .venv/bin/python bench/soak.py                       # 300 steps, P = 4096 (a few minutes)
    .venv/bin/python bench/soak.py --steps 40 --prompt-tokens 1024 --out bench/out/soak_smoke.csv

Prints a short table and ends with one JSON line (the summary).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import code_info, cpu_model, status_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_command(args, out_dir: str) -> list[str]:
    """The `longstraw train` command line of the soak (the tiny dense preset, exact mode)."""
    return [sys.executable, "-m", "longstraw.cli", "train", "--model", "dense", "--arm", args.arm,
            "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps),
            "--chunk-size", str(args.chunk_size), "--group-size", str(args.group_size),
            "--eval-every", str(args.eval_every), "--eval-prompts", str(args.eval_prompts),
            "--checkpoint-every", str(args.checkpoint_every), "--warm-steps", str(args.warm_steps),
            "--warm-cache", os.path.join(out_dir, "warm"), "--threads", str(args.threads),
            "--seed", str(args.seed), "--out-dir", out_dir, "--no-progress"]


def read_steps(log_path: str) -> list[dict]:
    """The step records of the log so far (the loop rewrites it whole, atomically)."""
    try:
        with open(log_path) as f:
            return [r for r in map(json.loads, f) if "reward_mean" in r]
    except FileNotFoundError:
        return []


def soak(args) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="soak-")
    log_path = os.path.join(out_dir, "log.jsonl")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(train_command(args, out_dir), cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    rows, seen, t0 = [], 0, time.perf_counter()
    while True:
        done = child.poll() is not None
        rss, hwm = status_bytes("VmRSS", child.pid), status_bytes("VmHWM", child.pid)
        records = read_steps(log_path)
        for r in records[seen:]:  # normally one new step per poll (a step takes > 0.1 s)
            rows.append({"step": r["step"], "rss_bytes": rss, "hwm_bytes": hwm, "wall_s": time.perf_counter() - t0,
                         "time_step_s": r["time_step_s"], "reward_mean": r["reward_mean"], "loss": r["loss"],
                         "skipped_zero_advantage": r["skipped_zero_advantage"],
                         "nonfinite_grad": r.get("nonfinite_grad", 0.0),
                         "evaluated": float(any(k.endswith("_accuracy") for k in r))})
        seen = len(records)
        if done:
            break
        time.sleep(0.02)
    if child.returncode != 0:
        raise SystemExit(f"longstraw train exited with {child.returncode} (run dir {out_dir})")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--arm", default="exact", choices=["detached", "exact", "full"])
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--warm-steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early", type=int, default=30, help="the step RSS is compared against (default 30)")
    p.add_argument("--out", default=None, help="CSV of the rows (default bench/results/soak_p<P>.csv)")
    args = p.parse_args()
    out = args.out or os.path.join(ROOT, "bench", "results", f"soak_p{args.prompt_tokens}.csv")

    rows = soak(args)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    by_step = {r["step"]: r for r in rows}
    early, last = by_step[args.early], rows[-1]
    growth = last["rss_bytes"] / early["rss_bytes"] - 1
    print(f"{'step':>6} {'RSS MiB':>9} {'peak MiB':>9} {'s/step':>7}")
    for r in rows:
        if r["step"] in (1, 10, args.early) or r["step"] % 50 == 0 or r is last:
            print(f"{r['step']:>6} {r['rss_bytes'] / 2**20:>9.1f} {r['hwm_bytes'] / 2**20:>9.1f} "
                  f"{r['time_step_s']:>7.2f}")
    rss = [r["rss_bytes"] for r in rows if r["step"] >= args.early]
    summary = {
        "bench": "soak", "steps": last["step"], "prompt_tokens": args.prompt_tokens, "arm": args.arm,
        "group_size": args.group_size, "chunk_size": args.chunk_size, "threads": args.threads,
        f"rss_step{args.early}_bytes": early["rss_bytes"], f"rss_step{last['step']}_bytes": last["rss_bytes"],
        "rss_growth": growth, "rss_max_after_early_bytes": max(rss), "rss_min_after_early_bytes": min(rss),
        "updates_applied": sum(1 for r in rows if not r["skipped_zero_advantage"] and not r["nonfinite_grad"]),
        "median_step_s": sorted(r["time_step_s"] for r in rows)[len(rows) // 2],
        "pass": abs(growth) <= 0.05, "cpu": cpu_model(), **code_info(ROOT, short=True), "rows": os.path.relpath(out, ROOT),
    }
    print(f"RSS step {args.early} -> {last['step']}: {early['rss_bytes'] / 2**20:.1f} -> "
          f"{last['rss_bytes'] / 2**20:.1f} MiB ({growth:+.2%}; bar: within 5%) "
          f"{'PASS' if summary['pass'] else 'MISS'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
