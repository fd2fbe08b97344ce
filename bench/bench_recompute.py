"""Layer-wise recompute in replay (`ExecConfig(recompute_layers=True)`) against replay
without it: the replay peak above the model and the step's replay time, CPU.

The physics. A replay piece of T tokens run with autograd keeps every layer's saved
activations until its backward: about T x (a dozen hidden-sized tensors + the MLP's
intermediates) per layer, for all L layers. With recompute, each layer keeps only its
input [T, d] during the forward; backward recomputes one layer at a time, so the live
graph is L x T x d plus one layer's activations. The price is one more forward of the
piece (forward ~ 1/3 of forward + backward), so replay should take about 4/3 as long.

Setup (defaults): the tiny hybrid (`longstraw.tiny.tiny_model("qwen3_5")`: 3 Gated
DeltaNet : 1 attention layers, hidden 256), float32, 2 CPU threads, P = 16,384, G = 4,
R = 1,024 in one piece. Each setting runs in a fresh subprocess: it captures the prompt
once, then (1) times one `Engine.step` on that capture's group (`time_replay_s`: the G
branches' replay) and (2) measures the live-tensor peak (profiler allocation events,
`bench/live_peak.py`) of replaying one branch against the captured state, above what
was alive before (model, grads, state), and (3) replays the G branches again, timed in
this process's CPU seconds (steadier than wall time on a shared machine). Ratios are
taken within the one run.

    .venv/bin/python bench/bench_recompute.py                       # ~ minutes on 2 cores
    .venv/bin/python bench/bench_recompute.py --prompt 2048 --response 256   # smoke
Last line: one JSON object with every raw number; `--out` writes the rows as CSV.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args) -> dict:
    import torch

    import longstraw as ls
    from bench.live_peak import live_tensor_peak
    from bench.proc import own_cpu_s
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    torch.set_num_threads(args.threads)
    model = tiny_model(args.family, dtype=torch.float32)
    group = uniform_group(model.config.vocab_size, args.prompt, args.group, args.response, seed=0)
    engine = ls.Engine(model, ls.ExecConfig(recompute_layers=args.recompute, chunk_size=args.chunk_size,
                                            branch_chunk_size=args.pieces))
    t0 = time.perf_counter()
    metrics = engine.step(group).metrics
    step_s = time.perf_counter() - t0
    state = engine.capture(group.prompt)
    response = group.responses[0]

    def replay_one():
        engine.replay_branch(state, group.prompt, response,
                             lambda hidden, a, b: engine.logprobs(hidden, response[a:b], 1.0).sum())

    peak = live_tensor_peak(replay_one)
    cpu0, t0 = own_cpu_s(), time.perf_counter()  # the G branches again, timed by this process's CPU seconds
    for response in group.responses:
        engine.replay_branch(state, group.prompt, response,
                             lambda hidden, a, b, r=response: engine.logprobs(hidden, r[a:b], 1.0).sum())
    cpu_s, wall_s = own_cpu_s() - cpu0, time.perf_counter() - t0
    return dict(recompute=int(args.recompute), replay_peak_bytes=peak, time_replay_s=metrics["time_replay_s"],
                time_step_s=step_s, replay_cpu_s=cpu_s, replay_wall_s=wall_s,
                recompute_metric=metrics["recompute_layers"], state_bytes=metrics["state_bytes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--pieces", type=int, default=None, help="branch_chunk_size (default: one piece)")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="CSV of the raw rows")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--recompute", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.recompute = bool(args.recompute)
        print(json.dumps(worker(args)))
        return
    rows = []
    for recompute in (0, 1):
        cmd = [sys.executable, __file__, "--worker", "--recompute", str(recompute)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k not in ("worker", "recompute", "out") and v is not None]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        row = dict(family=args.family, prompt=args.prompt, group=args.group, response=args.response,
                   pieces=args.pieces or args.response, **json.loads(out.stdout.strip().splitlines()[-1]))
        rows.append(row)
    none, rc = rows
    print(f"{'recompute':>9} {'replay peak MiB':>16} {'replay s':>9} {'replay CPU s':>13} {'step s':>8}")
    for r in rows:
        print(f"{r['recompute']:>9} {r['replay_peak_bytes'] / 2**20:>16.1f} {r['time_replay_s']:>9.2f} "
              f"{r['replay_cpu_s']:>13.2f} {r['time_step_s']:>8.2f}")
    ratios = dict(peak_ratio=none["replay_peak_bytes"] / rc["replay_peak_bytes"],
                  replay_time_ratio=rc["time_replay_s"] / none["time_replay_s"],
                  replay_cpu_ratio=rc["replay_cpu_s"] / none["replay_cpu_s"])
    print(f"replay peak, none / recompute: {ratios['peak_ratio']:.2f}x; replay time, recompute / none: "
          f"{ratios['replay_time_ratio']:.2f}x wall, {ratios['replay_cpu_ratio']:.2f}x CPU seconds "
          "(on a shared machine the CPU-seconds ratio is the steadier one)")
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(json.dumps(dict(rows=rows, **ratios)))


if __name__ == "__main__":
    main()
