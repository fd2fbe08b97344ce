"""Steps in one process: does anything outlive its step? (issue 43, item 1 and "no state
outlives its step")

After each of `--steps` steps on the same inputs this prints one row: the step, the
process RSS (MiB, read after `gc.collect()` and glibc's `malloc_trim(0)`, so freed heap
goes back to the OS), the number of live tensors (gc walk) and of those with a
`grad_fn`. A run without a leak is flat from step 2 on and has 0 graph tensors.

Scenarios (`--scenario`), each exact mode on tiny qwen3 (`longstraw.tiny.tiny_model`),
float32, 2 CPU threads, one `Engine` for every step:

    kept     `keep_graph_bytes` = --keep-mib (default 458 MiB, less than one chunk's graph:
             capture measures chunk 0 with autograd, keeps none). Before the fix of item 1
             that measured graph was never freed: one chunk graph per step.
    offload  `state_device="cpu"`: the state's rows in a host arena, staged a layer at a
             time (kept graphs are refused with offload, so none).
    tree     `share_response_prefixes=True` and --keep-mib: the G responses share their
             first half (a prefix tree of segment states, walked once per segment).
    episode  `generate` with an environment (the lower half of the vocabulary ends a turn,
             so each branch makes --turns calls; 4 observation tokens each, absorbed into the
             branch's own state), then `step(group, state=rollout.state)` and --keep-mib
             (kept graphs apply to a step's own capture only, so chunk 0 is not measured).

The defaults are the issue's run (P = 8,192, chunk 4,096, G = 2 responses of 64 tokens):

    .venv/bin/python bench/leak_steps.py                        # ~ a minute on 2 cores
    .venv/bin/python bench/leak_steps.py --keep-mib 0           # the baseline: no kept graphs
    .venv/bin/python bench/leak_steps.py --scenario tree --steps 5 --out bench/results/leak_steps_tree.csv
Last line: one JSON object with every row.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import gc
import json
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCENARIOS = ("kept", "offload", "tree", "episode")


def rss_mib() -> float:
    """The resident set size of this process in MiB (Linux /proc), after `gc.collect()`
    and `malloc_trim(0)` (where glibc has it): the heap that is free is not counted."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
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


def scenario_step(args, model):
    """A no-argument callable that runs one step of `args.scenario` on `model`."""
    import torch

    import longstraw as ls
    from tests.reference import uniform_group

    keep = int(args.keep_mib * 2**20)
    exec_args = dict(mode="exact", chunk_size=args.chunk)
    vocab = model.config.vocab_size
    group = uniform_group(vocab, args.prompt, args.group, args.response, seed=0)
    if args.scenario == "kept":
        engine = ls.Engine(model, ls.ExecConfig(**exec_args, keep_graph_bytes=keep))
        return lambda: engine.step(group)
    if args.scenario == "offload":
        engine = ls.Engine(model, ls.ExecConfig(**exec_args, state_device="cpu"))
        return lambda: engine.step(group)
    if args.scenario == "tree":
        engine = ls.Engine(model, ls.ExecConfig(**exec_args, keep_graph_bytes=keep, share_response_prefixes=True))
        for r in group.responses[1:]:
            r[: args.response // 2] = group.responses[0][: args.response // 2]
        return lambda: engine.step(group)
    engine = ls.Engine(model, ls.ExecConfig(**exec_args, keep_graph_bytes=keep))

    def environment(branch, response):
        return torch.tensor([vocab - 4, vocab - 3, vocab - 2, vocab - 1 - branch])

    def episode():
        rollout = engine.generate(group.prompt, num_samples=args.group, max_new_tokens=args.response,
                                  eos_token_id=list(range(vocab // 2)), generator=torch.Generator().manual_seed(1),
                                  environment=environment, max_turns=args.turns, prefix=group.responses[0][:1])
        assert rollout.turns == [args.turns] * args.group, f"environment calls per branch: {rollout.turns}"
        engine.step(ls.Group(prompt=group.prompt, responses=rollout.responses, rewards=group.rewards,
                             loss_masks=rollout.loss_masks), state=rollout.state)

    return episode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=SCENARIOS, default="kept")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--turns", type=int, default=2, help="episode: environment calls per branch")
    p.add_argument("--keep-mib", type=float, default=458)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    import torch

    from longstraw.tiny import tiny_model

    torch.set_num_threads(args.threads)
    model = tiny_model(args.family, dtype=torch.float32)
    step_once = scenario_step(args, model)
    rows = []
    for step in range(1, args.steps + 1):
        model.zero_grad(set_to_none=True)
        step_once()
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
