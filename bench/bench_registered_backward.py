"""What the registered GDN op's recomputing backward costs on the real (CPU, torch) path.

`ops/registered.py` keeps only the kernel's inputs in the autograd graph and, in the
backward, runs the torch kernel forward again under autograd before differentiating it:
one more kernel forward per backward. This times forward + backward of
`longstraw::gdn_chunk` against the plain torch function (`gated_delta._torch_chunk`,
its autograd graph kept) in the same process, fp32, one GDN layer of the qwen3.6-27b
shapes (Hk 16, Hv 48, Dk = Dv = 128) at T tokens; median of `--repeats`.

    PYTHONPATH=. python bench/bench_registered_backward.py 512 2048
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from longstraw.ops import gated_delta

ROWS = "bench/results/registered_backward.jsonl"


def inputs(t: int):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(t, 16, 128, generator=gen) for _ in range(2))
    v = torch.randn(t, 48, 128, generator=gen)
    g, beta = -torch.rand(t, 48, generator=gen) * 0.5, torch.rand(t, 48, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, torch.zeros(48, 128, 128))]


def timed(fn, xs, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        o, s = fn(xs)
        torch.autograd.grad((o.sum() + s.sum()), xs[:5])
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(argv):
    repeats = 3
    print(f"{'T':>6} {'plain s':>8} {'op s':>8} {'op/plain':>9}")
    for t in map(int, argv):
        xs = inputs(t)
        plain = timed(lambda x: gated_delta._torch_chunk(*x, chunk_size=64, flag=True), xs, repeats)
        op = timed(lambda x: gated_delta.GDN_CHUNK_OP(x, 64, True), xs, repeats)
        row = {"T": t, "plain_s": plain, "op_s": op, "ratio": op / plain, "dtype": "float32", "threads":
               torch.get_num_threads(), "machine": "2 shared CPU cores"}
        print(f"{t:>6} {plain:8.3f} {op:8.3f} {op / plain:9.2f}")
        with open(ROWS, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
