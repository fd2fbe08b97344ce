"""A rehearsal's own cost against P: wall time, CPU time, peak RSS and fake ops of
rehearsing Qwen3.6-27B (the preset, bf16, one rank, CPU branches) at the paper's G = 8,
R = 8,192 in pieces of 2,048, chunks of 4,096, detached (or `P:fake:exact`; `bench_rehearse.one`), per
prompt length P and fake mode: `fast` (`rehearsal/fast_fake.RehearsalFakeMode`, the
default) or `torch` (`FakeTensorMode`, `LONGSTRAW_FAST_FAKE=0`).

Each (P, fake mode) runs in a fresh process, one after the other (its own peak RSS; run
the whole script under `taskset -c N` to pin it). Each row is appended to
bench/results/rehearse_scaling.csv as it finishes, with the rehearsed peak over the
planner's for the same step (first group, optimizer state off) and the 1-minute load
average (a loaded core inflates wall_s, not cpu_s).

    taskset -c 1 env PYTHONPATH=. python bench/bench_rehearse_scaling.py 32768:torch 32768:fast 131072:fast
    python bench/bench_rehearse_scaling.py --extrapolate 2088960     # from the committed rows, no rehearsal

`--extrapolate P` fits a least-squares line through the `fast` detached rows (ops, cpu_s, wall_s,
peak RSS against P) and prints its value at P: an extrapolation, not a measurement.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

ROWS = "bench/results/rehearse_scaling.csv"
FIELDS = ["P", "G", "R", "mode", "fake_mode", "wall_s", "cpu_s", "peak_rss_bytes", "ops", "rehearsed_peak_bytes",
          "planned_peak_bytes", "rehearsed_over_planned", "load_avg_1m", "commit"]


def row(P: int, fake: str, commit: str, mode: str = "detached") -> dict:
    """Rehearse P in a fresh process with fake mode `fake` in engine mode `mode`; the CSV row."""
    env = dict(os.environ, LONGSTRAW_FAST_FAKE="0" if fake == "torch" else "1")
    bench = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_rehearse.py")
    from bench_rehearse import G, R  # noqa: PLC0415 (this script's own directory)
    out = subprocess.run([sys.executable, bench, "--one", str(P), str(G), str(R), mode], capture_output=True, text=True,
                         check=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    reh, planned = r["rehearsal"], r["planner"]["peak_bytes_per_rank"]
    return {"P": P, "G": r["G"], "R": r["R"], "mode": mode, "fake_mode": fake, "wall_s": round(r["wall_s"], 1),
            "cpu_s": round(r["cpu_s"], 1), "peak_rss_bytes": r["peak_rss_bytes"], "ops": sum(reh["ops"]),
            "rehearsed_peak_bytes": reh["peak_bytes_per_rank"], "planned_peak_bytes": planned,
            "rehearsed_over_planned": round(reh["peak_bytes_per_rank"] / planned, 4),
            "load_avg_1m": round(r["load_avg_1m"], 2), "commit": commit}


def extrapolate(P: int, path: str = ROWS) -> dict:
    """Each column's least-squares line through the `fast` rows at `P` (an extrapolation)."""
    rows = [r for r in csv.DictReader(open(path)) if r["fake_mode"] == "fast" and r["mode"] == "detached"]
    xs = [float(r["P"]) for r in rows]
    if len(set(xs)) < 2:
        raise SystemExit(f"--extrapolate needs fast rows at two P or more in {path}; it has {sorted(set(xs))}")
    mx = sum(xs) / len(xs)
    out = {"P": P, "from_P": sorted(int(x) for x in set(xs))}
    for col in ("ops", "cpu_s", "wall_s", "peak_rss_bytes"):
        ys = [float(r[col]) for r in rows]
        my = sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        out[col] = round(my + slope * (P - mx), 1)
        out[f"{col}_per_token"] = slope
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["--extrapolate"]:
        print(json.dumps(extrapolate(int(argv[1]))))
        return
    runs = [(int(p), f, m[0] if m else "detached") for p, f, *m in (a.split(":") for a in argv)]
    bad = [a for (_, f, m), a in zip(runs, argv) if f not in ("fast", "torch") or m not in ("detached", "exact")]
    if bad or not runs:
        raise SystemExit(f"usage: bench_rehearse_scaling.py P:fast|torch[:detached|exact] ...; bad: {bad or argv}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    new = not os.path.exists(ROWS)
    for P, fake, mode in runs:
        r = row(P, fake, commit, mode)
        with open(ROWS, "a", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if new:
                w.writeheader()
                new = False
            w.writerow(r)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
