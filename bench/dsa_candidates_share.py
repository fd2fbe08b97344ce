"""Sparse DSA's candidate exchange in the planner's GLM-5.2 H20 GPU sweep (issue 46), before and
after `parallel.topk.global_topk`: per GPU count, `--fit`'s step time with the candidates planned
as the old all-gather ((W-1) K 8 B a query), as the global top-k
(`plan.traffic.candidate_bytes_per_query`), and with no candidate bytes at all on the same
configuration; the candidates' share = (time - time without them) / time.

Usage: python bench/dsa_candidates_share.py [--out bench/results/dsa_candidates_share.json]
(torch-free: the planner only; one JSON line per GPU count)
"""

from __future__ import annotations

import argparse
import contextlib
import json

from longstraw.plan import PlanConfig, parse_bytes
from longstraw.plan import comm, traffic
from longstraw.plan.estimate import estimate
from longstraw.plan.fit import Fit, flags, search

GPUS = (32, 64, 128, 256, 512, 1024)
BASE = dict(prompt_tokens=2_088_960, group=8, response_tokens=8192, lora_rank=8, gpu="h20",
            reserve=parse_bytes("14.4GiB"))


@contextlib.contextmanager
def candidate_bytes(fn):
    """Plan with `fn(W, K)` as the bytes per query of the candidates' exchange."""
    saved = traffic.candidate_bytes_per_query
    comm.candidate_bytes_per_query = traffic.candidate_bytes_per_query = fn
    try:
        yield
    finally:
        comm.candidate_bytes_per_query = traffic.candidate_bytes_per_query = saved


def row(w: int, term, label: str) -> dict:
    with candidate_bytes(term):
        res = search("glm-5.2", PlanConfig(gpus=w, **BASE), ())
    if not isinstance(res, Fit):
        return {"gpus": w, "candidates": label, "fits": False}
    t = res.report["estimated_time_s"]
    with candidate_bytes(lambda W, K, score_bytes=4: 0.0):
        t0 = estimate("glm-5.2", res.config)["estimated_time_s"]
    return {"gpus": w, "candidates": label, "flags": flags(res.config), "time_s": t, "time_without_s": t0,
            "share": (t - t0) / t if t else 0.0, "comm_share": res.report["comm"]["exposed_s"] / t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/dsa_candidates_share.json")
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)))
    args = ap.parse_args()
    rows = []
    for w in map(int, args.gpus.split(",")):
        for label, term in (("all_gather", traffic.gathered_topk_bytes_per_query), ("global_topk", traffic.radix_topk_bytes_per_query)):
            rows.append(row(w, term, label))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
