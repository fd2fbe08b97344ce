"""The paper's runs rehearsed at full size (issue 44): `longstraw plan ... --rehearse
--json` in a fresh process per run, its wall time, CPU time and peak RSS measured
(`os.wait4`), the planner's and the rehearsal's peak per rank and per phase side by side.

Each run is a named flag set (`RUNS`): the paper's step (P = 2,088,960, G = 8, R = 8,192)
on its GPUs (Qwen3.6-27B on 8 H20s, GLM-5.2 on 32), LoRA at the paper's rank, bf16
weights (a rehearsal cannot build NF4: the paper's Qwen run used it; the plan compared is
the bf16 one, the same step the rehearsal runs). With `--fit` (the default) the planner
chooses the configuration (`--gpu h20 --reserve 14.4GiB --fit`, as
`bench/results/planned/run.sh`) and the rehearsal runs the one it chose. Extra flags after
`--` are added to every run (e.g. `-- --chunk-size 2048` for twice the chunks, or
`-- --prompt-tokens 4460000` for the stress run). Rows are appended to
bench/results/rehearse_paper.csv as each run finishes.

    PYTHONPATH=. taskset -c 0 python bench/bench_rehearse_paper.py qwen-detached qwen-exact glm
    PYTHONPATH=. python bench/bench_rehearse_paper.py --steps 2 qwen-detached
    PYTHONPATH=. python bench/bench_rehearse_paper.py --no-fit --label chunks-x2 qwen-detached -- \\
        --mode detached --chunk-size 2048 --branch-chunk-size 2048 --offload-state --shard-params
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

ROWS = "bench/results/rehearse_paper.csv"
STEP = "--prompt-tokens 2088960 --group 8 --response-tokens 8192"
RUNS = {
    "qwen-detached": f"--model qwen3.6-27b {STEP} --gpus 8 --lora-rank 16 --mode detached",
    "qwen-exact": f"--model qwen3.6-27b {STEP} --gpus 8 --lora-rank 16 --mode exact",
    "glm": f"--model glm-5.2 {STEP} --gpus 32 --lora-rank 8 --mode detached",
    # the paper's step context-parallel on 8 ranks, full training, pieces of 2,048, nothing else (with --no-fit)
    "qwen-cp": f"--model qwen3.6-27b {STEP} --gpus 8 --branch-chunk-size 2048 --mode detached",
}
FIT = "--gpu h20 --reserve 14.4GiB --fit"
FIELDS = ["run", "label", "steps", "flags", "chosen", "P", "W", "wall_s", "cpu_s", "peak_rss_bytes", "ops",
          "rehearsed_peak_bytes", "planned_peak_bytes", "rehearsed_over_planned", "phase_ratios", "step_peaks",
          "host_syncs", "rank", "fits", "load_avg_1m", "commit"]


def run(name: str, *, fit: bool, steps: int, extra: list[str]) -> dict:
    """One run in a fresh process: its row (the JSON report's rehearsal, the process's own cost)."""
    argv = RUNS[name].split() + (FIT.split() if fit else []) + extra
    argv += ["--rehearse", "--rehearse-steps", str(steps), "--allow-position-overflow", "--json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "longstraw.cli", "plan", *argv], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) not in (0, 3):  # 3: the rehearsed peak does not fit (still a row)
        raise SystemExit(f"{name}: longstraw plan exited {status}")
    report = json.loads(out)
    reh = report["rehearsal"]
    ratios = {k: round(v, 4) for k, v in reh["ratio"].items()}
    P = [int(a) for flag, a in zip(argv, argv[1:]) if flag == "--prompt-tokens"][-1]
    return {"run": name, "steps": steps, "flags": " ".join(argv), "P": P,
            "chosen": " ".join(report["fit"]["flags"]) if fit and report.get("fit") else "",
            "W": reh["world_size"], "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "ops": sum(reh["ops"]),
            "rehearsed_peak_bytes": reh["peak_bytes_per_rank"],
            "planned_peak_bytes": reh["planner"]["peak_bytes_per_rank"],
            "rehearsed_over_planned": ratios.pop("peak_bytes_per_rank"), "phase_ratios": json.dumps(ratios),
            "step_peaks": json.dumps(reh["step_peaks"]), "host_syncs": reh["host_syncs"], "rank": reh["rank"],
            "fits": reh["fits"], "load_avg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str]) -> None:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", choices=sorted(RUNS))
    p.add_argument("--steps", type=int, default=1, help="steps per rehearsal (2: a leak shows)")
    p.add_argument("--no-fit", action="store_true", help="plan the run's flags (and the extra ones) as given")
    p.add_argument("--label", default="", help="a word for the rows (e.g. chunks-x2)")
    p.add_argument("--out", default=ROWS)
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name in args.runs:
        row = run(name, fit=not args.no_fit, steps=args.steps, extra=extra) | {"label": args.label, "commit": commit}
        new = not os.path.exists(args.out)
        with open(args.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
