"""Time a rehearsal of the Qwen3.6-27B preset cut to a few layers (one rank, CPU
branches, bf16): its wall and CPU seconds, its ops and their cost. For A/B runs of two
checkouts of the rehearsal's dispatch, one rehearsal a process, e.g.

    for i in 1 2 3 4 5; do for tree in /tmp/before .; do
        (cd $tree && PYTHONPATH=. python /work/main/bench/time_rehearse_cut.py --label $tree)
    done; done >> bench/results/rehearse_dispatch_ab.txt

or, with `--ab-dynamo-wrapper N`, N rounds in one warm process alternating the tracker's
`__torch_dispatch__` as torch wraps a dispatch mode's (`torch._disable_dynamo`) and as
`LiveBytes` now leaves it (less noise than a process a run on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import longstraw as ls  # noqa: E402
from longstraw.rehearsal.tracker import LiveBytes  # noqa: E402
from profile_rehearse import hf_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=524288)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--mode", default="exact")
    ap.add_argument("--label", default="")
    ap.add_argument("--ab-dynamo-wrapper", type=int, default=0, metavar="N")
    args = ap.parse_args()
    cfg = ls.ExecConfig(chunk_size=args.chunk, mode=args.mode, branch_chunk_size=2048, allow_position_overflow=True)
    hf = hf_config(args.layers)

    def once(label: str) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        r = ls.rehearse(hf, cfg, prompt_tokens=args.prompt_tokens, group=2, response_tokens=2048, device="cpu",
                        dtype=torch.bfloat16)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        ops = r.steps[0].ops
        print(f"{label} layers={args.layers} P={args.prompt_tokens} chunk={args.chunk} mode={args.mode} "
              f"wall_s={wall:.2f} cpu_s={cpu:.2f} ops={ops} cpu_us_per_op={1e6 * cpu / ops:.1f} "
              f"peak={r.peak_bytes_per_rank} load1={os.getloadavg()[0]:.2f}", flush=True)

    if not args.ab_dynamo_wrapper:
        once(args.label)
        return
    raw = LiveBytes.__torch_dispatch__
    arms = {"wrapped": torch._disable_dynamo(raw, recursive=True), "unwrapped": raw}
    once("warm-up")
    for _ in range(args.ab_dynamo_wrapper):
        for label, dispatch in arms.items():
            LiveBytes.__torch_dispatch__ = dispatch
            once(label)
    LiveBytes.__torch_dispatch__ = raw


if __name__ == "__main__":
    main()
