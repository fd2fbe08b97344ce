"""Bytes and time of sparse DSA's candidate exchange across context ranks on gloo (issue 46):
`parallel.topk.global_topk` against the all-gather it replaced, at W = 2, 3, 4, with the
planner's bytes per query (`plan.traffic`'s `gathered_topk_bytes_per_query`,
`radix_topk_bytes_per_query`) beside the measured ones.

Each rank holds B queries' top-K candidates of its own shard (random fp32 scores); the
selection of both arms is checked equal. Rows: world, arm, bytes per query (measured,
planned), seconds (fastest of 3).

Usage: python bench/bench_topk_bytes.py [--queries 128] [--topk 2048] [--out bench/results/topk_bytes.csv]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longstraw.parallel.collectives import Traffic
from longstraw.parallel.context import ContextParallel
from longstraw.parallel.topk import gathered_topk, global_topk
from longstraw.plan.traffic import gathered_topk_bytes_per_query, radix_topk_bytes_per_query


def _rank(rank: int, world: int, init: str, queries: int, topk: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    cp = ContextParallel(group=dist.group.WORLD, rank=rank, world=world)
    g = torch.Generator().manual_seed(rank)
    sc = torch.rand(queries, topk, generator=g).sort(dim=1, descending=True).values
    pos = torch.randperm(topk * 64, generator=g)[:topk].expand(queries, -1) * world + rank  # distinct across ranks
    rows, results = [], {}
    for arm, fn in (("all_gather", gathered_topk), ("global_topk", global_topk)):
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            before, t0 = Traffic.received, time.perf_counter()
            results[arm] = fn(pos, sc, topk, cp)
            best = min(best, time.perf_counter() - t0)
            moved = Traffic.received - before
        planned = (gathered_topk_bytes_per_query if arm == "all_gather" else radix_topk_bytes_per_query)(world, topk)
        rows.append(dict(world=world, arm=arm, queries=queries, topk=topk, bytes_per_query=moved / queries,
                         planned_bytes_per_query=planned, seconds=best))
    assert all(torch.equal(a, b) for a, b in zip(results["all_gather"], results["global_topk"]))
    if rank == 0:
        with open(out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if f.tell() == 0:
                w.writeheader()
            w.writerows(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--out", default="bench/results/topk_bytes.csv")
    args = ap.parse_args()
    for world in map(int, args.worlds.split(",")):
        init = os.path.join(tempfile.mkdtemp(), "init")
        mp.spawn(_rank, args=(world, init, args.queries, args.topk, os.path.abspath(args.out)), nprocs=world)
    print(open(args.out).read())


if __name__ == "__main__":
    main()
