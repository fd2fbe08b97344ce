"""Every GPU check in one command: the first thing to run when a GPU is lent.

CPU CI cannot reach the CUDA paths: NCCL collectives, the fused flash kernels, bf16 on
tensor cores, pinned-memory offload, the Qwen3.6-27B layer shapes at long prompts. This
script runs each check of `bench/gpu/` in its own subprocess (a CUDA error, an OOM or a
per-process memory cap cannot leak into the next one), each under its own time limit, and
keeps going past a check that fails, times out or crashes. It writes one JSON of results
and prints a table.

    python bench/gpu_suite.py                       # one GPU: at most 8 minutes (--budget-s 480), estimated ~7 on an H200
    python bench/gpu_suite.py --cpu                 # smoke run of every check on CPU (~1 min)
    python bench/gpu_suite.py --only checks cp      # a subset

The checks (their own docstrings say what each measures):

    checks   correctness on the device: CP over NCCL vs one process, bf16 exact mode vs
             float64, the autocast refusal, greedy generate vs HF, a bf16 CP rollout
             (`bench/gpu/checks.py`)
    features what came after `checks`: prefix trees vs the flat group, an agent episode
             (environment, loss masks) vs score, layer recompute on vs off, snapshots on
             host vs on the device, expert parallelism with HF's grouped_mm experts vs the
             eager MoE (`bench/gpu/features.py`)
    cp       a divided capture and an exact step per world size (W = 1 on one GPU; more
             where there are more GPUs) with bytes received vs the planner (`bench/gpu/cp.py`)
    offload  state offload: device peak vs depth at fixed P (flat when offloaded) and the
             copy/compute overlap (`bench/gpu/offload.py`)
    stack    a Qwen3.6-27B-shaped stack at the largest P that fits its time budget, next to
             the planner's prediction; the fused kernel vs the blockwise one (`bench/gpu/stack.py`)
    trainer  one step of `LongStrawGRPOTrainer` over NCCL: W = 1 against W = 2 (C = 2 and
             C = 1) and W = 4, 8 where the GPUs exist, loss and gradient agreement; with
             fewer than 2 GPUs it runs W = 1 alone and says why (`bench/gpu/trainer.py`)

Output: `--out` (default `$OUT/gpu_suite.json` when $OUT is set, else
`bench/out/gpu_suite.json`): {"device", "torch", "cpu", "total_s", "all_ok", "checks":
[{"name", "ok", "rc", "wall_s", "limit_s", "result" (the check's last JSON line) or
"error" (the tail of its output)}]}. Ends with one JSON line of the same. Exit code 0
when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (module, GPU argv, CPU argv, GPU time limit s). The limits add up to 13.5 minutes;
# each is a ceiling, not an estimate (on one GPU the trainer check runs W = 1 alone, ~1 min).
# The suite's own budget (--budget-s, 8 minutes on a GPU) caps them further: a check gets
# at most what is left of it, and one the budget cannot reach is reported, not run.
CHECKS = {
    "checks": ("bench.gpu.checks", [], ["--cpu"], 90),
    "features": ("bench.gpu.features", [], ["--cpu"], 90),
    "cp": ("bench.gpu.cp", ["--family", "qwen3_5", "--prompt-tokens", "65536", "--worlds", "1", "2", "--exact",
                            "--out", "{tmp}/cp_gpu.csv"],
           ["--family", "qwen3_5", "--prompt-tokens", "2048", "--chunk-size", "512", "--block", "256",
            "--group", "2", "--response-tokens", "8", "--worlds", "1", "2", "--exact", "--out", "{tmp}/cp.csv"], 90),
    "offload": ("bench.gpu.offload", ["--prompt-tokens", "131072", "--layers", "8,16,32", "--slack-gib", "2",
                                      "--time-tokens", "32768", "--time-layers", "16"], ["--cpu"], 150),
    "stack": ("bench.gpu.stack", ["--layers", "4", "--budget-s", "120"], ["--dry"], 150),
    "trainer": ("bench.gpu.trainer", [], ["--cpu", "--prompt-tokens", "32", "--response-tokens", "4", "--hidden", "64",
                                          "--chunk-size", "16"], 240),
}


def last_json(text: str) -> dict | None:
    """The last line of `text` that parses as a JSON object, else None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_check(name: str, cpu: bool, tmp: str, scale: float, left_s: float = float("inf")) -> dict:
    """Run one check in a fresh interpreter, within its limit and `left_s`; never raises."""
    module, gpu_argv, cpu_argv, limit = CHECKS[name]
    argv = [a.format(tmp=tmp) for a in (cpu_argv if cpu else gpu_argv)]
    limit = min(limit * scale, left_s)
    if limit <= 0:
        return {"name": name, "rc": None, "wall_s": 0.0, "limit_s": 0.0, "ok": False,
                "error": "not run: the suite's --budget-s is spent"}
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # the suite writes the one JSON
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=limit)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += f"\n[timed out after {limit:.0f} s]"
    wall = time.perf_counter() - t0
    result = last_json(text) if rc == 0 else None
    row = {"name": name, "rc": rc, "wall_s": round(wall, 2), "limit_s": limit}
    if result is None:
        row.update(ok=False, error=text[-2000:])
    else:
        # a check's own verdict where it gives one (checks: all_ok); otherwise it ran to the end
        row.update(ok=bool(result.get("all_ok", True)), result=result)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="smoke run on CPU (no GPU needed)")
    ap.add_argument("--only", nargs="+", choices=sorted(CHECKS), help="run only these checks")
    ap.add_argument("--limit-scale", type=float, default=1.0, help="multiply every time limit (a slow machine)")
    ap.add_argument("--out", help="where the JSON goes")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="wall-clock cap of the whole suite on a GPU (x4 with --cpu, as the limits)")
    args = ap.parse_args()
    import tempfile

    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    out = args.out or os.path.join(os.environ.get("OUT") or os.path.join(REPO, "bench", "out"), "gpu_suite.json")
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(CHECKS):
            print(f"[gpu_suite] {name} ...", flush=True)
            scale = args.limit_scale * (4.0 if cpu else 1.0)
            left = args.budget_s * scale - (time.perf_counter() - t0)
            rows.append(run_check(name, cpu, tmp, scale, left))
            print(f"[gpu_suite] {name}: {'ok' if rows[-1]['ok'] else 'FAILED'} in {rows[-1]['wall_s']} s", flush=True)
    summary = {"bench": "gpu_suite", "device": device, "torch": torch.__version__, "cpu": cpu,
               "total_s": round(time.perf_counter() - t0, 2), "all_ok": all(r["ok"] for r in rows), "checks": rows}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n{'check':<10} {'ok':<4} {'rc':>4} {'wall s':>8} {'limit s':>8}")
    for r in rows:
        print(f"{r['name']:<10} {'yes' if r['ok'] else 'NO':<4} {str(r['rc']):>4} {r['wall_s']:>8.1f} {r['limit_s']:>8.0f}")
        if not r["ok"]:
            print("    " + r["error"].strip().splitlines()[-1][:200] if r.get("error") else "    check said not ok")
    print(f"written: {out}")
    print(json.dumps(summary))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
