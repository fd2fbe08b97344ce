"""Fault run: SIGKILL `longstraw train` while it writes a checkpoint, 20 times, restart it
each time, and check that every restart resumes from a valid checkpoint onto the curve of
one uninterrupted run with the same seeds.

Why. The loop writes its checkpoint, its log and its config by write-then-rename
(`train.write_atomic`): a kill at any moment leaves the old file or the new one. And a
resumed run draws every random number of a step from a generator seeded by (seed, step),
restores the optimizer and the RNG state, and truncates the log to the checkpoint's step,
so it continues the same curve. Both claims are tested here by force.

How. A reference run goes uninterrupted (small P, a checkpoint every step). The faulted
run uses the same flags in another directory. For each of `--kills` kills the parent starts
the CLI, waits for the child's k-th checkpoint write to begin (`checkpoint.pt.tmp`
appears; k random in 1..3), sleeps a random 0..`--max-delay-ms`, and sends SIGKILL. The
kill then lands inside the write (the .tmp file is left behind) or just after it. After
each kill the parent loads `checkpoint.pt` with `torch.load(weights_only=True)` (valid?
which step?) and compares every step record in `log.jsonl` with the reference's: the
losses, rewards, gradient norms, clip fractions and KLs must be equal, bit for bit (wall
times and memory readings excepted). After the last kill the run finishes; its final
weights must equal the reference's.

    .venv/bin/python bench/fault_run.py                  # 20 kills, about 5 minutes on 2 cores
    .venv/bin/python bench/fault_run.py --kills 3 --steps 12 --out bench/out/fault_smoke

Writes `<out>.csv` (one row per kill) and `<out>.json` (the summary); ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import code_info, cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = ("tokens_per_s", "peak_rss_bytes")  # and every "time" key: they differ between runs by nature


def comparable(record: dict) -> dict:
    """A log record without what differs between runs by nature: wall times, memory, and
    the warm-start line's warm_* (trained in the reference run, loaded from its cache here)."""
    return {k: v for k, v in record.items() if "time" not in k and k not in MEASURED and not k.startswith("warm_")}


def train_command(args, out_dir: str, warm_dir: str) -> list[str]:
    return [sys.executable, "-m", "longstraw.cli", "train", "--model", "dense", "--arm", args.arm,
            "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps), "--chunk-size", "64",
            "--group-size", "4", "--eval-every", "5", "--eval-prompts", "2", "--checkpoint-every", "1",
            "--warm-steps", "30", "--warm-batch", "8", "--warm-prompt-tokens", "128", "--warm-cache", warm_dir,
            "--threads", "1", "--seed", str(args.seed), "--out-dir", out_dir, "--no-progress"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def read_log(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def off_curve(log: list[dict], reference: dict[int, dict]) -> list[int]:
    """Steps whose record differs from the reference's (a duplicated step counts too)."""
    steps = [r["step"] for r in log]
    bad = [s for s in set(steps) if steps.count(s) > 1]
    return sorted(bad + [r["step"] for r in log if comparable(r) != comparable(reference[r["step"]])])


def kill_during_checkpoint(cmd, out_dir: str, rng: random.Random, max_delay_ms: float) -> dict:
    """Start the loop; SIGKILL it a random moment after its k-th checkpoint write began."""
    tmp = os.path.join(out_dir, "checkpoint.pt.tmp")
    if os.path.exists(tmp):
        os.remove(tmp)  # a .tmp left by the previous kill: wait for this run's own writes
    writes_to_skip = rng.randint(0, 2)
    delay = rng.uniform(0, max_delay_ms) / 1000
    child = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, writing = 0, False
    while child.poll() is None:
        now = os.path.exists(tmp)
        if now and not writing:
            if seen == writes_to_skip:
                time.sleep(delay)
                child.send_signal(signal.SIGKILL)
                break
            seen += 1
        writing = now
        time.sleep(0.0002)
    child.wait()
    err = child.stderr.read().decode()
    return {"returncode": child.returncode, "delay_ms": delay * 1000, "writes_skipped": writes_to_skip,
            "tmp_left": os.path.exists(tmp), "stderr": err[-500:] if child.returncode not in (0, -9) else ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=45)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--arm", default="exact", choices=["detached", "exact", "full"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-seed", type=int, default=0, help="seeds the kill moments")
    p.add_argument("--max-delay-ms", type=float, default=3.0)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fault_p256"))
    args = p.parse_args()
    rng = random.Random(args.kill_seed)
    work = tempfile.mkdtemp(prefix="fault-")
    warm, ref_dir, run_dir = (os.path.join(work, d) for d in ("warm", "reference", "faulted"))

    t0 = time.perf_counter()
    subprocess.run(train_command(args, ref_dir, warm), cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
    reference = {r["step"]: r for r in read_log(ref_dir)}
    t_ref = time.perf_counter() - t0
    cmd = train_command(args, run_dir, warm)

    rows = []
    for kill in range(args.kills):
        resumed_from = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)["step"] \
            if os.path.exists(os.path.join(run_dir, "checkpoint.pt")) else 0
        info = kill_during_checkpoint(cmd, run_dir, rng, args.max_delay_ms)
        row = {"kill": kill + 1, "resumed_from_step": resumed_from, **info}
        try:
            ckpt = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
            row.update(checkpoint_valid=True, checkpoint_step=ckpt["step"])
        except Exception as exc:  # noqa: BLE001 - a broken checkpoint is the failure we count
            row.update(checkpoint_valid=False, checkpoint_step=-1, error=f"{type(exc).__name__}: {exc}"[:200])
        try:
            log = read_log(run_dir)
            row.update(log_valid=True, logged_steps=max(r["step"] for r in log), off_curve=off_curve(log, reference))
        except Exception as exc:  # noqa: BLE001
            row.update(log_valid=False, logged_steps=-1, off_curve=[-1], error=f"{type(exc).__name__}: {exc}"[:200])
        rows.append(row)
        print(f"kill {row['kill']:>2}: resumed from step {resumed_from:>2}, killed after {row['delay_ms']:.2f} ms "
              f"{'inside' if row['tmp_left'] else 'after'} a checkpoint write (rc {row['returncode']}); checkpoint "
              f"{'valid' if row['checkpoint_valid'] else 'BROKEN'} at step {row['checkpoint_step']}, log to step "
              f"{row['logged_steps']}, off the curve: {row['off_curve'] or 'none'}", flush=True)
        if info["returncode"] == 0:
            print("  (the run finished before this kill)")
        elif info["returncode"] != -signal.SIGKILL:
            raise SystemExit(f"the loop failed by itself: {info['stderr']}")

    final = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = read_log(run_dir)
    a = torch.load(os.path.join(ref_dir, "checkpoint.pt"), weights_only=True)
    b = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    same_weights = a["step"] == b["step"] == args.steps and all(torch.equal(v, b["model"][k]) for k, v in
                                                                a["model"].items())
    final_off = off_curve(log, reference)
    summary = {
        "bench": "fault_run", "kills": len(rows), "steps": args.steps, "prompt_tokens": args.prompt_tokens,
        "arm": args.arm, "kills_inside_a_checkpoint_write": sum(r["tmp_left"] for r in rows),
        "checkpoints_valid": sum(r["checkpoint_valid"] for r in rows), "logs_valid": sum(r["log_valid"] for r in rows),
        "restarts_on_curve": sum(r["log_valid"] and not r["off_curve"] for r in rows),
        "final_returncode": final.returncode, "final_steps_logged": len([r for r in log if r["step"] > 0]),
        "final_off_curve": final_off, "final_weights_equal_reference": bool(same_weights),
        "reference_time_s": t_ref, "total_time_s": time.perf_counter() - t0, "cpu": cpu_model(),
        **code_info(ROOT, short=True),
    }
    summary["pass"] = (summary["checkpoints_valid"] == summary["logs_valid"] == summary["restarts_on_curve"]
                       == len(rows) and final.returncode == 0 and not final_off and same_weights
                       and summary["final_steps_logged"] == args.steps)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "stderr"] + ["error"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{summary['kills']} kills ({summary['kills_inside_a_checkpoint_write']} inside a checkpoint write): "
          f"{summary['checkpoints_valid']} valid checkpoints, {summary['restarts_on_curve']} restarts on the curve; "
          f"final weights equal the reference's: {same_weights}  {'PASS' if summary['pass'] else 'FAIL'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
