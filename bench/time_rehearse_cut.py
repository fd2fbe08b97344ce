"""Time one rehearsal of the Qwen3.6-27B preset cut to a few layers (one rank, CPU
branches, bf16), nothing else running in the process: its wall and CPU seconds, its ops
and their cost, for A/B runs of two checkouts of the rehearsal's dispatch, e.g.

    for i in 1 2 3 4 5; do for tree in /tmp/before .; do
        (cd $tree && PYTHONPATH=. python /work/main/bench/time_rehearse_cut.py --label $tree)
    done; done >> bench/results/rehearse_dispatch_ab.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import longstraw as ls  # noqa: E402
from profile_rehearse import hf_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=524288)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--mode", default="exact")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    cfg = ls.ExecConfig(chunk_size=args.chunk, mode=args.mode, branch_chunk_size=2048, allow_position_overflow=True)
    t0, c0 = time.perf_counter(), time.process_time()
    r = ls.rehearse(hf_config(args.layers), cfg, prompt_tokens=args.prompt_tokens, group=2, response_tokens=2048,
                    device="cpu", dtype=torch.bfloat16)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ops = r.steps[0].ops
    print(f"{args.label} layers={args.layers} P={args.prompt_tokens} chunk={args.chunk} mode={args.mode} "
          f"wall_s={wall:.2f} cpu_s={cpu:.2f} ops={ops} cpu_us_per_op={1e6 * cpu / ops:.1f} "
          f"peak={r.peak_bytes_per_rank} load1={os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
