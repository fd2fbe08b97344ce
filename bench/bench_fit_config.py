"""`ls.fit_config` on CPU at tiny sizes: does the chosen ExecConfig's step stay inside the
budget it was fitted to? For each family, mode and budget (a roomy one and `tight`, the
smallest whole MiB `fit_config` accepts) a fresh process builds the tiny model,
allocates its gradients, asks `fit_config` for the fastest config, runs a warm-up step
of a small group with that config, reads its RSS, runs the measured step, and reads the
peak RSS. The budget counts what the step adds above the loaded model and its gradients, so

    peak_above = VmHWM during the step - RSS before it

is the measured figure, and the pass condition is peak_above <= 1.1 x budget.

The warm-up (P = 2 chunks, 2 responses; then `malloc_trim`): the first step of a process
maps the code of every kernel it runs for the first time (file-backed pages of
libtorch, 29 MiB for tiny qwen3_5), which RSS counts but no device budget holds. The
rows record that growth (`warmup_file_growth`) and the file-backed growth during the
measured step (`step_file_growth`, ~0 after the warm-up).

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
    BENCH_THREADS=1 python bench/bench_fit_config.py --family qwen3_5 --prompt-tokens 16384 \\
        --response-tokens 1024 --budgets 1GiB tight --out bench/results/fit_config_cpu_loaded.csv
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
          "warmup_file_growth", "step_file_growth", "machine", "cpu", "torch"]
MACHINE = os.environ.get("BENCH_MACHINE", "loaded machine")
"""How busy the machine was (the rows' `machine` column): set BENCH_MACHINE=idle on an idle one."""


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def worker(family: str, mode: str, P: int, G: int, R: int, budget: str) -> dict:
    """One fresh-process measurement (see the module docstring)."""
    import ctypes
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
    if budget == "tight":
        budget = f"{tightest(model, P, G, R, mode)}MiB"
    cfg = ls.fit_config(model, memory_budget=budget, prompt_tokens=P, group=G, response_tokens=R, mode=mode)
    engine = ls.Engine(model, cfg)
    file0 = _status("RssFile")
    piece = min(R, 2 * (cfg.branch_chunk_size or R))
    engine.step(uniform_group(model.config.vocab_size, min(P, 2 * cfg.chunk_size), 2, piece, seed=1))  # warm-up
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    warm_file = _status("RssFile") - file0
    plan = estimate(planner_config(model), PlanConfig(
        prompt_tokens=P, group=G, response_tokens=R, mode=mode, dtype="float32", chunk_size=cfg.chunk_size,
        branch_chunk_size=cfg.branch_chunk_size, recompute_layers=cfg.recompute_layers,
        keep_graph_bytes=cfg.keep_graph_bytes))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before, file1 = _status("VmRSS"), _status("RssFile")
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
            "threads": THREADS, "warmup_file_growth": warm_file, "step_file_growth": _status("RssFile") - file1,
            "machine": MACHINE, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__}


def tightest(model, P: int, G: int, R: int, mode: str) -> int:
    """The smallest whole MiB budget `fit_config` accepts for this step (a bisection)."""
    import longstraw as ls

    def fits(mib: int) -> bool:
        try:
            ls.fit_config(model, memory_budget=mib * 2**20, prompt_tokens=P, group=G, response_tokens=R, mode=mode)
            return True
        except ls.DoesNotFitError:
            return False

    lo, hi = 1, 1
    while not fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


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
    ap.add_argument("--budgets", nargs="+", default=["1GiB", "tight"], help="sizes, or 'tight' (see the docstring)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "fit_config_cpu_loaded.csv"))
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
