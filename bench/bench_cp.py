"""Context parallelism on CPU: does adding ranks make capture and a step faster?

Physics. Capture's cost is the token computation (projections, MLP, GDN; ~linear in P)
plus attention over the prompt (~P^2 / 2). Before the divided capture only the attention
part was split over W ranks; now each prompt token is computed on one rank (layer by
layer over the rank's own blocks, `longstraw/parallel/divided.py`), so capture should
approach 1/W plus communication: per attention layer (W-1)/W * P * Hkv * (D + Dv) values
received, per GDN layer one [Hv, Dk, Dv] state per block received plus the conv tails
and the kept snapshots. A detached step adds the G branches' replay, which stays
replicated (R-sized), so it divides less.

Measurement. Every W runs in fresh processes: the driver starts one worker process per
(family, W, method), which spawns W gloo ranks (`torch.multiprocessing`, file init);
each rank calls torch.set_num_threads(1). W = 1 is the plain single-process engine with
1 thread. Per rank: build `longstraw.tiny.tiny_model(family, float32)` and a random group
(G, R), warm up on a short prompt, then time `engine.capture(prompt)` and one detached
`engine.step(group)` (barrier before each; the slowest rank's time is reported), and
count the bytes each rank received through LongStraw's collectives
(`parallel.collectives.Traffic`), against the model's prediction
(`plan.traffic.divided_capture_traffic`). On a 2-core machine W = 3 oversubscribes the
cores; its rows say so (`oversubscribed`).

Methods: `divided` (the default: each token on one rank) and `replicated`
(`ExecConfig(divide_capture=False)`: every rank runs every token, as before).

Usage:
    .venv/bin/python bench/bench_cp.py --families qwen3_5 qwen3 --prompt-tokens 32768 --worlds 1 2 3 \\
        --out bench/results/cp_cpu.csv
    # exact mode too: one exact step per W (its reverse walk divided for `divided`, replicated for `replicated`)
    .venv/bin/python bench/bench_cp.py --families qwen3_5 qwen3 --worlds 1 2 3 --methods divided replicated \
        --exact --out bench/results/cp_cpu_exact.csv
Prints a table, the ratios to W = 1, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import code_info, cpu_model  # noqa: E402  (torch-free)

FIELDS = ["family", "world", "method", "prompt_tokens", "group", "response_tokens", "chunk_size", "block",
          "capture_s", "step_s", "capture_bytes_received_max", "capture_bytes_predicted", "step_bytes_received_max",
          "exact_step_s", "exact_reverse_s", "exact_divided_walk", "oversubscribed", "cores", "cpu", "revision", "dirty"]


# ============================================================================
# worker: one (family, W, method), W ranks


def _rank(rank: int, world: int, init: str, args, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import longstraw as ls
    from longstraw.parallel.collectives import Traffic
    from longstraw.plan.traffic import divided_capture_traffic
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    torch.set_num_threads(1)
    cp = world > 1 or args.method != "single"
    if cp:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = tiny_model(args.family, dtype=torch.float32)
    kw = dict(chunk_size=args.chunk_size, attention_block_size=args.block, context_parallel=cp,
              divide_capture=args.method != "replicated")
    engine = ls.Engine(model, ls.ExecConfig(**kw))
    exact = ls.Engine(model, ls.ExecConfig(mode="exact", divide_walk=args.method != "replicated", **kw)) \
        if args.exact else None
    group = uniform_group(4096, args.prompt_tokens, args.group, args.response_tokens, seed=0)
    warm = uniform_group(4096, min(args.prompt_tokens, 4 * args.block * max(world, 1) + 1), 1, 8, seed=1)
    engine.step(warm)  # imports, allocator, first-call costs
    if exact is not None:
        exact.step(warm)
        model.zero_grad(set_to_none=True)

    def timed(fn):
        if cp:
            dist.barrier()
        Traffic.received = 0
        t0 = time.perf_counter()
        fn()
        if cp:
            dist.barrier()
        return time.perf_counter() - t0, Traffic.received

    t_capture, b_capture = timed(lambda: engine.capture(group.prompt))
    t_step, b_step = timed(lambda: engine.step(group))
    t_exact, t_reverse, walk_divided = float("nan"), float("nan"), float("nan")
    if exact is not None:
        model.zero_grad(set_to_none=True)
        got = {}
        t_exact, _ = timed(lambda: got.update(exact.step(group).metrics))
        t_reverse, walk_divided = got["time_reverse_s"], got.get("divided_walk", 0.0)
    predicted = divided_capture_traffic(model.config.to_dict(), positions=args.prompt_tokens - 1, world=world,
                                        block=args.block, chunk_size=args.chunk_size, dtype="float32") \
        if args.method == "divided" else float("nan")
    row = torch.tensor([t_capture, t_step, float(b_capture), float(b_step), t_exact, t_reverse, walk_divided],
                       dtype=torch.float64)
    if cp:
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        dist.destroy_process_group()
    else:
        rows = [row]
    if rank == 0:
        worst = torch.stack(rows).max(0).values.tolist()
        with open(out, "w") as f:
            json.dump({"capture_s": worst[0], "step_s": worst[1], "capture_bytes_received_max": worst[2],
                       "step_bytes_received_max": worst[3], "capture_bytes_predicted": predicted,
                       "exact_step_s": worst[4], "exact_reverse_s": worst[5], "exact_divided_walk": worst[6]}, f)


def worker(args) -> None:
    import torch.multiprocessing as mp

    out = args.result
    if args.world == 1 and args.method == "single":
        _rank(0, 1, "", args, out)
        return
    init = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(_rank, args=(args.world, init, args, out), nprocs=args.world, join=True)


# ============================================================================
# driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["qwen3_5", "qwen3"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", default=["divided"], choices=["divided", "replicated"])
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--block", type=int, default=1024, help="attention_block_size (= the shard block)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "cp_cpu.csv"))
    ap.add_argument("--exact", action="store_true", help="also time one exact-mode step (its reverse walk divided "
                    "for method divided, replicated for method replicated)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--family"), ap.add_argument("--world", type=int), ap.add_argument("--method")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    cores = os.cpu_count() or 1
    info = code_info(REPO, short=True)
    rows = []
    for family in args.families:
        for world in args.worlds:
            for method in (["single"] if world == 1 else args.methods):
                result = tempfile.mktemp(suffix=".json")
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--family", family, "--world",
                       str(world), "--method", method, "--result", result, "--prompt-tokens", str(args.prompt_tokens),
                       "--group", str(args.group), "--response-tokens", str(args.response_tokens), "--chunk-size",
                       str(args.chunk_size), "--block", str(args.block)] + (["--exact"] if args.exact else [])
                subprocess.run(cmd, check=True)
                with open(result) as f:
                    got = json.load(f)
                row = dict(family=family, world=world, method=method, prompt_tokens=args.prompt_tokens,
                           group=args.group, response_tokens=args.response_tokens, chunk_size=args.chunk_size,
                           block=args.block, oversubscribed=world > cores, cores=cores, cpu=cpu_model(),
                           revision=info["git_rev"], dirty=info["longstraw_dirty"], **got)
                rows.append(row)
                print(f"{family:8s} W={world} {method:10s} capture {got['capture_s']:8.2f} s  step "
                      f"{got['step_s']:8.2f} s  received {got['capture_bytes_received_max'] / 2**20:9.2f} MiB "
                      f"(predicted {got['capture_bytes_predicted'] / 2**20:9.2f})"
                      + (f"  exact step {got['exact_step_s']:8.2f} s (walk {got['exact_reverse_s']:.2f} s)"
                         if args.exact else "")
                      + ("  [oversubscribed]" if world > cores else ""), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    new = not os.path.exists(args.out)
    fields = FIELDS
    if not new:  # append under the file's own header (files written before a column was added)
        with open(args.out) as f:
            fields = next(csv.reader(f))
    with open(args.out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    ratios = {}
    for r in rows:
        base = next((b for b in rows if b["family"] == r["family"] and b["world"] == 1), None)
        if base is not None and r["world"] > 1:
            ratios[f"{r['family']}_W{r['world']}_{r['method']}"] = {
                "capture": r["capture_s"] / base["capture_s"], "step": r["step_s"] / base["step_s"],
                "exact_step": r["exact_step_s"] / base["exact_step_s"] if args.exact else None,
                "oversubscribed": r["oversubscribed"]}
    for k, v in ratios.items():
        print(f"{k:28s} capture {v['capture']:.2f}x  step {v['step']:.2f}x"
              + (f"  exact step {v['exact_step']:.2f}x" if args.exact else "") + ("  [oversubscribed]" if v[
            "oversubscribed"] else ""))
    print(json.dumps({"bench": "bench_cp", "prompt_tokens": args.prompt_tokens, "ratios_to_W1": ratios}))


if __name__ == "__main__":
    main()
