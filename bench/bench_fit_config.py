"""`ls.fit_config` on CPU at tiny sizes: does the chosen ExecConfig's step stay inside the
budget it was fitted to? For each budget (a roomy one and a tight one) a fresh process
builds the tiny model, allocates its gradients, reads its RSS, asks `fit_config` for the
fastest config, runs one `engine.step`, and reads the peak RSS. The budget counts what
the step adds above the loaded model and its gradients, so

    peak_above = VmHWM after the step - RSS before it (model + gradients already resident)

is the measured figure, and the pass condition is peak_above <= 1.1 x budget.

Physics: what the step adds is the prompt state (and in exact mode its gradient), plus
the largest phase's working set (a capture chunk, a replay piece's graph, a walk chunk's
graph). A tight budget makes the search shrink the pieces and chunks (and turn recompute
on) until the planner's peak fits; the measurement says whether the planner's working
sets are honest on this allocator.

Measurement: float32, `BENCH_THREADS` torch threads (default 1), glibc held to returning
freed memory (MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 MALLOC_ARENA_MAX=1,
as docs/planner.md's validation), VmHWM reset (`/proc/self/clear_refs` 5) just before
the step so the model build's own peak does not count. Each row records the machine.

Usage:
    BENCH_THREADS=1 python bench/bench_fit_config.py --budgets 1GiB 24MiB \\
        --out bench/results/fit_config_cpu.csv
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "1"}
FIELDS = ["family", "mode", "P", "G", "R", "budget", "budget_bytes", "peak_above", "ratio", "planned_above",
          "chunk_size", "branch_chunk_size", "recompute_layers", "keep_graph_bytes", "step_time_s", "threads",
          "cpu", "torch"]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(family: str, mode: str, P: int, G: int, R: int, budget: str) -> dict:
    """One fresh-process measurement (see the module docstring)."""
    import gc
    import time

    import torch

    import longstraw as ls
    from longstraw.plan import PlanConfig, estimate
    from longstraw.shapes import planner_config
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the budget is above the model and its gradients
    group = uniform_group(model.config.vocab_size, P, G, R, seed=0)
    cfg = ls.fit_config(model, memory_budget=budget, prompt_tokens=P, group=G, response_tokens=R, mode=mode)
    engine = ls.Engine(model, cfg)
    plan = estimate(planner_config(model), PlanConfig(
        prompt_tokens=P, group=G, response_tokens=R, mode=mode, dtype="float32", chunk_size=cfg.chunk_size,
        branch_chunk_size=cfg.branch_chunk_size, recompute_layers=cfg.recompute_layers,
        keep_graph_bytes=cfg.keep_graph_bytes))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    t0 = time.perf_counter()
    engine.step(group)
    dt = time.perf_counter() - t0
    peak_above = _status("VmHWM") - before
    budget_bytes = ls.budget.parse_budget(budget, torch.device("cpu"))
    return {"family": family, "mode": mode, "P": P, "G": G, "R": R, "budget": budget, "budget_bytes": budget_bytes,
            "peak_above": peak_above, "ratio": peak_above / budget_bytes,
            "planned_above": plan["peak_bytes_per_rank"] - plan["param_bytes"] - plan["grad_bytes"]
            - plan["optimizer_bytes"], "chunk_size": cfg.chunk_size, "branch_chunk_size": cfg.branch_chunk_size,
            "recompute_layers": cfg.recompute_layers, "keep_graph_bytes": cfg.keep_graph_bytes, "step_time_s": dt,
            "threads": THREADS, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}


def measure(family: str, mode: str, P: int, G: int, R: int, budget: str) -> dict:
    """`worker` in a fresh interpreter with the malloc settings; its dict."""
    env = {**os.environ, **MALLOC, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", family, mode, str(P), str(G), str(R),
                          budget], capture_output=True, text=True, env=env, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--modes", nargs="+", default=["detached", "exact"])
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--response-tokens", type=int, default=512)
    ap.add_argument("--budgets", nargs="+", default=["1GiB", "64MiB"])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "fit_config_cpu.csv"))
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        f, m, P, G, R, b = a.worker
        print(json.dumps(worker(f, m, int(P), int(G), int(R), b)))
        return
    rows = [measure(a.family, mode, a.prompt_tokens, a.group, a.response_tokens, b)
            for mode in a.modes for b in a.budgets]
    new = not os.path.exists(a.out)
    with open(a.out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"bench_fit_config | tiny {a.family}, float32, CPU, {THREADS} thread(s) | P {a.prompt_tokens} "
          f"G {a.group} R {a.response_tokens}")
    for r in rows:
        print(f"  {r['mode']:8s} budget {r['budget']:>7s}  peak above model {r['peak_above'] / 2**20:8.1f} MiB "
              f"({r['ratio']:.2f}x)  planned {r['planned_above'] / 2**20:8.1f} MiB  chunk {r['chunk_size']} "
              f"pieces {r['branch_chunk_size']} recompute {r['recompute_layers']}  {r['step_time_s']:.1f} s")
    print(json.dumps({"bench": "fit_config", "rows": rows}))


if __name__ == "__main__":
    main()
