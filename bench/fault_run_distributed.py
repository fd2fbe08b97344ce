"""Distributed fault run: SIGKILL a random worker of `torchrun --standalone --max-restarts N
examples/torchrun_grpo.py` at random moments, from outside the run, `--kills` times, and
check that the restarted group ends on the weights of one uninterrupted run, bit for bit.

Why. Under torchrun a dead rank takes its group down: the agent stops the survivors and
starts every worker again with the same command line. That line must start from the last
*complete* checkpoint (`--resume latest`; DCP shards written as step-N.partial, renamed,
then the `latest` marker written atomically), and the restarted workers must be able to
form a process group again (`parallel.launch.init_distributed`: a PrefixStore per attempt
on the agent's store). float64 on gloo replays the same steps on the same inputs, so the
final weights must be bitwise those of a run that was never killed.

How. A reference run goes uninterrupted (W = 2, `--context-parallel C`, a DCP checkpoint
after every step, `--dump` of the full final weights). The faulted run is the same command
line under `--max-restarts kills + 2`. For each kill the parent waits for this attempt's
two workers, sleeps a random 0..`--max-delay-s` (most of an attempt on this machine is
start-up: imports, the process group, the model, the resume), and SIGKILLs a random one.
Each row says where it landed: the victim's rank, the last phase it had entered
(LONGSTRAW_PHASE_FILE, written by `parallel.launch.phase`; "start-up" when it had entered
none this attempt: imports, init, model, resume), the step `latest` named, and whether a
`.partial` folder was present (one being written, or one a kill left, which the next save
deletes). `--in-steps` counts the delay from the attempt's first phase instead, so the kills
land inside steps, collectives and checkpoint writes rather than mostly in start-up.
After the last kill the run goes on to the end; its final weights are compared.

    .venv/bin/python bench/fault_run_distributed.py --context-parallel 2     # 20 kills
    .venv/bin/python bench/fault_run_distributed.py --context-parallel 1 --kills 5
    .venv/bin/python bench/fault_run_distributed.py --in-steps --max-delay-s 8  # kills inside the steps

Machine: CPU, gloo, float64, OMP_NUM_THREADS=1, tiny qwen3 (the tests' task). Writes
`<out>.csv` (one row per kill) and `<out>.json`; ends with one JSON line.
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

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import code_info, cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--prompt-tokens", "48", "--chunk-size", "16", "--facts", "2", "--values", "2", "--keys", "2", "--filler",
        "2", "--group-size", "8", "--prompts", "2", "--lr", "1e-2", "--mode", "exact", "--dtype", "float64"]


def command(args, out: str, restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), os.path.join(ROOT, "examples", "torchrun_grpo.py"), *TASK,
            "--context-parallel", str(args.context_parallel), "--steps", str(args.steps), "--save-every", "1",
            "--resume", "latest", "--checkpoint-dir", os.path.join(out, "ck"), "--dump", os.path.join(out, "final.pt")]


def _env(phase_file: str = "") -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", LONGSTRAW_PHASE_FILE=phase_file)


def workers(agent: psutil.Process) -> dict[int, psutil.Process]:
    """The agent's live worker processes by RANK (from their environment)."""
    out = {}
    for child in agent.children(recursive=True):
        try:
            env = child.environ()
            if "RANK" in env and child.status() != psutil.STATUS_ZOMBIE:
                out[int(env["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def where(out: str, phase_file: str, rank: int, since: float) -> dict:
    """Where a kill of `rank` landed: the last phase it entered this attempt, the step the
    marker names, and whether a checkpoint was being written."""
    ck = os.path.join(out, "ck")
    path = f"{phase_file}.rank{rank}"
    phase = "start-up"
    if os.path.exists(path) and os.path.getmtime(path) >= since:
        with open(path) as f:
            phase = f.read().strip() or "start-up"
    marked = -1
    if os.path.exists(os.path.join(ck, "latest")):
        with open(os.path.join(ck, "latest")) as f:
            marked = int(f.read().strip().rsplit("step-", 1)[-1] or -1)
    partial = os.path.isdir(ck) and any(n.endswith(".partial") for n in os.listdir(ck))
    return {"phase": phase, "marked_step": marked, "partial_folder_present": partial}


def faulted_run(args, out: str, rng: random.Random) -> tuple[list[dict], int, str]:
    os.makedirs(out, exist_ok=True)
    phase_file = os.path.join(out, "phase")
    log_path = os.path.join(out, "torchrun.log")  # a file, not a pipe: a full pipe would block the agent
    log_file = open(log_path, "w")
    proc = subprocess.Popen(command(args, out, args.kills + 2), cwd=ROOT, env=_env(phase_file),
                            stdout=log_file, stderr=subprocess.STDOUT, text=True)
    agent, rows, seen = psutil.Process(proc.pid), [], set()
    try:
        while len(rows) < args.kills and proc.poll() is None:
            ws = workers(agent)
            if len(ws) < 2 or any(w.pid in seen for w in ws.values()):
                time.sleep(0.05)  # the previous attempt's survivor is still stopping, or this one not up yet
                continue
            seen.update(w.pid for w in ws.values())
            since = min(w.create_time() for w in ws.values())
            if args.in_steps:  # wait for this attempt's first phase: the kill lands in the steps, not start-up
                while proc.poll() is None and not any(
                        os.path.exists(f"{phase_file}.rank{r}") and os.path.getmtime(f"{phase_file}.rank{r}") >= since
                        for r in ws):
                    time.sleep(0.02)
            delay = rng.uniform(0, args.max_delay_s)
            time.sleep(delay)
            rank = rng.randrange(2)
            landed = where(out, phase_file, rank, since)
            try:
                os.kill(ws[rank].pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            rows.append({"kill": len(rows) + 1, "attempt": len(rows), "rank": rank, "delay_s": round(delay, 3),
                         "since_start_s": round(time.time() - since, 3), **landed})
            print(f"kill {len(rows):>2}: rank {rank} {delay:5.2f} s into attempt {len(rows) - 1} "
                  f"({rows[-1]['since_start_s']:.1f} s since its start): phase {landed['phase']!r}, latest step "
                  f"{landed['marked_step']}, a .partial folder present: {landed['partial_folder_present']}", flush=True)
        proc.wait(timeout=args.timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_file.close()
    with open(log_path) as f:
        return rows, proc.returncode, f.read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context-parallel", type=int, default=2, help="C: 2 (one group of two) or 1 (two groups)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=30, help="enough that 20 kills land before the end")
    p.add_argument("--max-delay-s", type=float, default=20.0)
    p.add_argument("--kill-seed", type=int, default=0)
    p.add_argument("--in-steps", action="store_true", help="count the delay from the attempt's first phase, not "
                                                            "its start (kills land in steps, collectives, checkpoints)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", default="")
    args = p.parse_args()
    out_base = args.out or os.path.join(ROOT, "bench", "results", f"fault_distributed_c{args.context_parallel}"
                                        + ("_in_steps" if args.in_steps else ""))
    rng = random.Random(args.kill_seed)
    work = tempfile.mkdtemp(prefix="fault-dist-")
    ref, run = os.path.join(work, "reference"), os.path.join(work, "faulted")

    t0 = time.perf_counter()
    subprocess.run(command(args, ref, 0), cwd=ROOT, env=_env(), check=True, capture_output=True)
    t_ref = time.perf_counter() - t0
    rows, rc, log = faulted_run(args, run, rng)
    a = torch.load(os.path.join(ref, "final.pt"), weights_only=True)
    b = torch.load(os.path.join(run, "final.pt"), weights_only=True) if rc == 0 else {}
    equal = rc == 0 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    for row in rows:
        row["final_weights_bitwise_equal"] = equal
    summary = {"bench": "fault_run_distributed", "world": 2, "context_parallel": args.context_parallel,
               "in_steps": args.in_steps, "max_delay_s": args.max_delay_s,
               "kills": len(rows), "kills_requested": args.kills, "steps": args.steps,
               "kills_in_startup": sum(r["phase"] == "start-up" for r in rows),
               "kills_during_checkpoint": sum("checkpoint" in r["phase"] for r in rows),
               "returncode": rc, "restart_count": last[-1]["restart_count"] if last else None,
               "final_weights_bitwise_equal": bool(equal), "reference_time_s": round(t_ref, 1),
               "total_time_s": round(time.perf_counter() - t0, 1), "dtype": "float64", "backend": "gloo",
               "cpu": cpu_model(), **code_info(ROOT, short=True)}
    summary["pass"] = bool(equal and len(rows) == args.kills)
    os.makedirs(os.path.dirname(out_base), exist_ok=True)
    if rows:
        with open(out_base + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    with open(out_base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    if rc != 0:
        print(log[-3000:])
    shutil.rmtree(work, ignore_errors=True)
    print(f"W=2 C={args.context_parallel}: {len(rows)} kills ({summary['kills_in_startup']} in start-up, "
          f"{summary['kills_during_checkpoint']} during a checkpoint), run rc {rc}; final weights bitwise equal to "
          f"the uninterrupted run's: {equal}  {'PASS' if summary['pass'] else 'FAIL'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
