"""Where the time of one GRPO step goes, by op, for exact mode and Prefix Grouper.

Each arm runs in a fresh subprocess (torch.set_num_threads(BENCH_THREADS, default 2)): the
tiny dense model of `bench_step.py` (`longstraw.tiny.tiny_model("qwen3")`, float32) and
`tests.reference.uniform_group(4096, P, G, R, seed=0)`; one step to warm up, then one step
under `torch.profiler` (CPU). Rows: the arm, the op (aten / autograd name), its self CPU
seconds and calls; the ops below 1% of the step are summed into "other". It answers what a
wall-time ratio cannot: which work both methods share (the fused attention kernels, the
matmuls) and which only one does.

Usage (Prefix Grouper from PyPI `prefix-grouper`, `bench/requirements.txt`):

    PYTHONPATH=.:<prefix-grouper> python bench/profile_cost.py --out bench/results/profile_cost_dense_8k.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

ARMS = ("exact", "prefix_grouper")


def worker(arm: str, p: int, g: int, r: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_step

    import longstraw as ls
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    model = tiny_model("qwen3", dtype=torch.float32)
    group = uniform_group(4096, p, g, r, seed=0)
    grpo = ls.GRPOConfig()
    if arm == "exact":
        engine = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=1024, attention_block_size=1024))
        run = lambda: engine.step(group, grpo)  # noqa: E731
    else:
        run = lambda: bench_step.prefix_grouper_step(model, group, grpo)  # noqa: E731
    run()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()]
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.prompt_tokens, args.groups, args.response_tokens)
    out = []
    for arm in ARMS:
        res = subprocess.run([sys.executable, __file__, "--worker", arm, "--prompt-tokens", str(args.prompt_tokens),
                              "--groups", str(args.groups), "--response-tokens", str(args.response_tokens)],
                             capture_output=True, text=True, check=True)
        rows = json.loads(res.stdout.strip().splitlines()[-1])
        total = sum(s for _, s, _ in rows)
        big = sorted([x for x in rows if x[1] >= 0.01 * total], key=lambda x: -x[1])
        other = sum(s for _, s, _ in rows if s < 0.01 * total)
        for name, s, n in big + [("other", other, 0), ("total", total, 0)]:
            out.append({"arm": arm, "op": name, "self_cpu_s": round(s, 4), "calls": n,
                        "share": round(s / total, 4)})
            print(f"{arm:15s} {name[:60]:60s} {s:8.3f} s {n:6d} {s / total:6.1%}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out[0]))
            w.writeheader()
            w.writerows(out)


if __name__ == "__main__":
    main()
