"""Distributed soak: `longstraw train` under `torchrun --standalone --nproc-per-node 2`
(context parallelism over both ranks) for 200 steps, every rank's resident set size read
after every step.

Why. A leak on one rank only (a collective's buffer kept, a gathered state never freed, a
process group's queue that grows) does not show in a one-process soak (bench/soak.py).
The working set of a step is fixed by P, G and the model, so after warm-up each rank's RSS
should be flat. The bar (issue 38): RSS of every rank at the last step within 5% of its
RSS at step `--early`.

How. The parent starts torchrun and polls the run's log.jsonl (rank 0 writes it); each time
a step's line appears it reads VmRSS and VmHWM of both workers (found among the agent's
children by their RANK) from /proc. One row per (step, rank).

    .venv/bin/python bench/soak_distributed.py                      # 200 steps, P = 1024
    .venv/bin/python bench/soak_distributed.py --steps 40 --out bench/out/soak_w2_smoke.csv

Machine: CPU, gloo, float32, one thread per rank. Prints a short table, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import code_info, cpu_model, status_bytes  # noqa: E402
from soak import read_steps, train_command  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ranks(agent: psutil.Process) -> dict[int, int]:
    """The agent's live workers: RANK -> pid."""
    out = {}
    for child in agent.children(recursive=True):
        try:
            env = child.environ()
            if "RANK" in env:
                out[int(env["RANK"])] = child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def soak(args) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="soak-w2-")
    log_path = os.path.join(out_dir, "log.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
           *train_command(args, out_dir)[1:]]  # "-m longstraw.cli train ..." under torchrun
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(args.threads))
    err = open(os.path.join(out_dir, "torchrun.err"), "w+")  # a file, not a pipe: a full pipe blocks the agent
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    agent, workers, rows, seen, t0 = psutil.Process(child.pid), {}, [], 0, time.perf_counter()
    while True:
        done = child.poll() is not None
        if len(workers) < args.world:
            workers = ranks(agent)
        records = read_steps(log_path)
        for r in records[seen:]:
            for rank, pid in sorted(workers.items()):
                rows.append({"step": r["step"], "rank": rank, "rss_bytes": status_bytes("VmRSS", pid),
                             "hwm_bytes": status_bytes("VmHWM", pid), "wall_s": round(time.perf_counter() - t0, 2),
                             "time_step_s": r["time_step_s"], "reward_mean": r["reward_mean"],
                             "evaluated": float(any(k.endswith("_accuracy") for k in r))})
        seen = len(records)
        if done:
            break
        time.sleep(0.02)
    if child.returncode != 0:
        err.seek(0)
        raise SystemExit(f"torchrun exited with {child.returncode} (run dir {out_dir}): {err.read()[-2000:]}")
    shutil.rmtree(out_dir, ignore_errors=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--arm", default="exact", choices=["detached", "exact"])
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-prompts", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=25)
    p.add_argument("--warm-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early", type=int, default=30, help="the step RSS is compared against (default 30)")
    p.add_argument("--out", default=None, help="CSV (default bench/results/soak_w<W>_p<P>.csv)")
    args = p.parse_args()
    out = args.out or os.path.join(ROOT, "bench", "results", f"soak_w{args.world}_p{args.prompt_tokens}.csv")

    rows = soak(args)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    last_step = max(r["step"] for r in rows)
    print(f"{'step':>6} " + " ".join(f"{'rank ' + str(k) + ' MiB':>12}" for k in range(args.world)))
    by = {(r["step"], r["rank"]): r for r in rows}
    for s in sorted({r["step"] for r in rows}):
        if s in (1, 10, args.early) or s % 50 == 0 or s == last_step:
            print(f"{s:>6} " + " ".join(f"{by[(s, k)]['rss_bytes'] / 2**20:>12.1f}" for k in range(args.world)
                                        if (s, k) in by))
    per_rank = {}
    for k in range(args.world):
        early, last = by[(args.early, k)]["rss_bytes"], by[(last_step, k)]["rss_bytes"]
        after = [r["rss_bytes"] for r in rows if r["rank"] == k and r["step"] >= args.early]
        per_rank[k] = {"rss_early_bytes": early, "rss_last_bytes": last, "growth": last / early - 1,
                       "max_after_early_bytes": max(after), "min_after_early_bytes": min(after)}
    summary = {"bench": "soak_distributed", "world": args.world, "steps": last_step,
               "prompt_tokens": args.prompt_tokens, "arm": args.arm, "group_size": args.group_size,
               "early_step": args.early, "per_rank": per_rank,
               "pass": all(abs(v["growth"]) <= 0.05 for v in per_rank.values()), "cpu": cpu_model(),
               **code_info(ROOT, short=True), "rows": os.path.relpath(out, ROOT)}
    for k, v in per_rank.items():
        print(f"rank {k}: RSS step {args.early} -> {last_step}: {v['rss_early_bytes'] / 2**20:.1f} -> "
              f"{v['rss_last_bytes'] / 2**20:.1f} MiB ({v['growth']:+.2%}; bar: within 5%)")
    print("PASS" if summary["pass"] else "MISS")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
