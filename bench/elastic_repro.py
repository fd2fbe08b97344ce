"""Elastic restart repro: does a restarted worker group form its process group again?

Why. Issue 38: under `torchrun --standalone --max-restarts N` the restarted workers of a
group whose rank was SIGKILLed sat in `init_process_group` for minutes. The workers are
clients of the elastic agent's TCPStore, which outlives the restart; plain env:// init
keys the group under the same names on every attempt, so a restarted rank may read the
killed rank's stale address. It is a race: it hangs on some tries, not all.

How. A 15-line worker (below): init, an all-reduce, rank 1 SIGKILLs itself on the first
attempt, then another all-reduce. Run `--tries` times under torchrun with `--max-restarts
2`, both ways: `plain` (`init_process_group("gloo")`, env://) and `longstraw`
(`parallel.launch.init_distributed`: a PrefixStore per attempt). A try that has not ended
after `--timeout-s` counts as hung (torchrun is stopped, its workers with it).

    .venv/bin/python bench/elastic_repro.py --tries 10

Writes bench/results/elastic_repro.csv (one row per try) and .json; ends with one JSON line.
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
from proc import code_info, cpu_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = '''
import datetime, os, signal, time, torch, torch.distributed as dist
if os.environ["VARIANT"] == "longstraw":
    from longstraw.parallel.launch import init_distributed
    init_distributed()
else:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1 and attempt == 0:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1)
dist.all_reduce(t)
print("ok", rank, attempt, flush=True)
dist.destroy_process_group()
'''


def one_try(script: str, variant: str, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", VARIANT=variant, LONGSTRAW_COLLECTIVE_TIMEOUT="60")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", script]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        hung = False
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun's agent stops its workers on SIGTERM
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        hung = True
    return {"variant": variant, "returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "hung": hung, "restarted_ok": out.count("\nok ") + out.startswith("ok "),
            "connect_refused": "Connection refused" in out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--timeout-s", type=float, default=90)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "elastic_repro"))
    args = p.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    rows = []
    for i in range(args.tries):
        for variant in ("plain", "longstraw"):  # interleaved: the same machine load for both
            rows.append({"try": i + 1, **one_try(f.name, variant, args.timeout_s)})
            r = rows[-1]
            print(f"try {i + 1:>2} {variant:>9}: rc {r['returncode']}, {r['seconds']:5.1f} s, hung {r['hung']}",
                  flush=True)
    os.unlink(f.name)
    summary = {"bench": "elastic_repro", "tries": args.tries, "timeout_s": args.timeout_s, "cpu": cpu_model(),
               **code_info(ROOT, short=True)}
    for variant in ("plain", "longstraw"):
        mine = [r for r in rows if r["variant"] == variant]
        summary[variant] = {"ok": sum(r["returncode"] == 0 for r in mine), "hung": sum(r["hung"] for r in mine),
                            "failed": sum(r["returncode"] != 0 and not r["hung"] for r in mine)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(args.out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
