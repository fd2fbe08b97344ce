"""Steps in one process: does anything outlive its step? (issue 43, item 1)

Exact mode with `keep_graph_bytes` > 0 measures capture chunk 0's graph with autograd
on; before the fix that graph was never freed when chunk 0 was not kept (a reference
cycle through the saved-tensor pack hook), one chunk graph per step. After each of
`--steps` `Engine.step` calls on the same group this prints one row: the step, the
process RSS (MiB), the number of live tensors (gc walk) and of those with a `grad_fn`.
A run without a leak is flat from step 2 on and has 0 graph tensors.

Setup (defaults, the issue's): tiny qwen3 (`longstraw.tiny.tiny_model("qwen3")`),
float32, 2 CPU threads, P = 8,192, chunk 4,096, G = 2 responses of 64 tokens,
keep_graph_bytes = 458 MiB (less than one chunk's graph: none kept).

    .venv/bin/python bench/leak_steps.py                        # ~ a minute on 2 cores
    .venv/bin/python bench/leak_steps.py --keep-mib 0           # the baseline: no kept graphs
    .venv/bin/python bench/leak_steps.py --out bench/results/leak_steps_after.csv
Last line: one JSON object with every row.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    """The current resident set size of this process in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def live_tensors() -> tuple[int, int]:
    """(live tensors, live tensors with a grad_fn) found by a gc walk after `gc.collect()`
    (every Python tensor object, whoever holds it)."""
    import torch

    gc.collect()
    tensors = graph = 0
    is_tensor: dict[type, bool] = {}  # by type: no isinstance on proxies or deprecated names
    for obj in gc.get_objects():
        kind = type(obj)
        if kind not in is_tensor:
            is_tensor[kind] = issubclass(kind, torch.Tensor)
        if is_tensor[kind]:
            tensors += 1
            graph += obj.grad_fn is not None
    return tensors, graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3")
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--keep-mib", type=float, default=458)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import torch

    import longstraw as ls
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    torch.set_num_threads(args.threads)
    model = tiny_model(args.family, dtype=torch.float32)
    group = uniform_group(model.config.vocab_size, args.prompt, args.group, args.response, seed=0)
    config = ls.ExecConfig(mode="exact", chunk_size=args.chunk, keep_graph_bytes=int(args.keep_mib * 2**20))
    engine = ls.Engine(model, config)
    rows = []
    for step in range(1, args.steps + 1):
        model.zero_grad(set_to_none=True)
        engine.step(group)
        tensors, graph = live_tensors()
        rows.append({"step": step, "rss_mib": round(rss_mib(), 1), "live_tensors": tensors, "graph_tensors": graph})
        print(f"step {step}: rss {rows[-1]['rss_mib']:.0f} MiB, live tensors {tensors}, with a grad_fn {graph}", flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))


if __name__ == "__main__":
    main()
