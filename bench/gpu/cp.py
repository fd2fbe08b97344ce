"""Divided capture on GPUs (NCCL): W = 1 against W = 2 (and more, as many as there are devices).

Physics as in `bench/bench_cp.py`: a divided capture runs each prompt token on one rank,
so capture should approach 1/W plus communication (K/V rows of the other ranks per
attention layer, one recurrent state per block per GDN layer, conv tails, snapshots),
which NVLink carries at hundreds of GB/s. A detached step adds the replicated replay.

Each W runs in fresh processes under `torchrun --nproc-per-node W` (one rank per device,
`cuda:LOCAL_RANK`, NCCL). Per rank: the model in bf16 (`--family`, a tiny preset scaled
by `--hidden` / `--layers`), a random group (G, R); warm-up, then capture and one detached
step (barrier + synchronize around each; the slowest rank reported), the bytes received
(`parallel.collectives.Traffic`) against `plan.traffic.divided_capture_traffic`, and the loss,
which must equal W = 1's within bf16 rounding (`--check`, reported). Devices with fewer than
W GPUs skip that W (NCCL needs one device per rank) and say so.

`--exact` also times one exact-mode step per W (its reverse walk divided: the blockwise
autograd attention with `own_rows`, the all-reduce merges, the bucketed gradient sum, all
over NCCL), with the walk's bytes received (`comm_bytes_reverse`) against
`plan.traffic.divided_walk_traffic`, and the gradient norm, which must equal W = 1's
within bf16 rounding.

Without CUDA the same script runs on CPU (gloo, float32): a smoke test of its own logic,
not a GPU measurement (`device` in the rows says which).

Usage (one machine, any number of GPUs):
    python bench/gpu/cp.py --family qwen3_5 --prompt-tokens 262144 --worlds 1 2 --exact --out bench/results/cp_gpu.csv
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def rank_main(args) -> None:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    import longstraw as ls
    from longstraw.parallel.collectives import Traffic
    from longstraw.measure import peak_rss_bytes
    from longstraw.plan.traffic import divided_capture_traffic, divided_walk_traffic
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    local = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(local)
    else:  # the CPU smoke test: one thread per rank
        torch.set_num_threads(1)
    cp = world > 1
    if cp:
        dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(minutes=10))
    dtype, dtype_name = (torch.bfloat16, "bfloat16") if gpu else (torch.float32, "float32")

    def sync():
        if gpu:
            torch.cuda.synchronize()
    overrides = {}
    if args.hidden:
        overrides.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
        if args.family == "qwen3_5":
            overrides["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (args.layers // 4)
    model = tiny_model(args.family, dtype=dtype, **overrides).to("cuda" if gpu else "cpu")
    kw = dict(chunk_size=args.chunk_size, attention_block_size=args.block, context_parallel=cp)
    engine = ls.Engine(model, ls.ExecConfig(**kw))
    group = uniform_group(4096, args.prompt_tokens, args.group, args.response_tokens, seed=0)
    engine.step(uniform_group(4096, 4 * args.block * world + 1, 1, 8, seed=1))  # warm-up

    def timed(fn):
        if cp:
            dist.barrier()
        sync()
        Traffic.received = 0
        t0 = time.perf_counter()
        out = fn()
        sync()
        if cp:
            dist.barrier()
        return time.perf_counter() - t0, Traffic.received, out

    t_cap, b_cap, _ = timed(lambda: engine.capture(group.prompt))
    model.zero_grad(set_to_none=True)
    t_step, b_step, result = timed(lambda: engine.step(group))
    predicted = divided_capture_traffic(model.config.to_dict(), positions=args.prompt_tokens - 1, world=world,
                                        block=args.block, chunk_size=args.chunk_size, dtype=dtype_name)
    exact = [float("nan")] * 6
    if args.exact:  # one exact step: its reverse walk divided
        model.zero_grad(set_to_none=True)
        t_ex, _, got = timed(lambda: ls.Engine(model, ls.ExecConfig(mode="exact", **kw)).step(group))
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
        walk_predicted = divided_walk_traffic(model.config.to_dict(), positions=args.prompt_tokens - 1, world=world,
                                              block=args.block, chunk_size=args.chunk_size, dtype=dtype_name)
        exact = [t_ex, got.metrics["time_reverse_s"], got.metrics["comm_bytes_reverse"], walk_predicted,
                 float(norm), got.metrics["divided_walk"]]
    peak = torch.cuda.max_memory_allocated() if gpu else peak_rss_bytes()
    row = torch.tensor([t_cap, t_step, float(b_cap), float(b_step), result.loss, peak / 2**30] + exact,
                       dtype=torch.float64, device="cuda" if gpu else "cpu")
    if cp:
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        dist.destroy_process_group()
    else:
        rows = [row]
    if int(os.environ.get("RANK", "0")) == 0:
        worst = torch.stack(rows).max(0).values.tolist()
        with open(args.result, "w") as f:
            json.dump({"world": world, "capture_s": worst[0], "step_s": worst[1], "capture_bytes_received": worst[2],
                       "step_bytes_received": worst[3], "loss": float(rows[0][4]), "peak_gib": worst[5],
                       "capture_bytes_predicted": predicted,
                       "divided_capture": result.metrics.get("divided_capture"),
                       "exact_step_s": worst[6], "exact_walk_s": worst[7], "walk_bytes_received": worst[8],
                       "walk_bytes_predicted": float(rows[0][9]), "exact_grad_norm": float(rows[0][10]),
                       "divided_walk": float(rows[0][11])}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_5")
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--prompt-tokens", type=int, default=262144)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--exact", action="store_true", help="also time one exact-mode step (divided walk)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "cp_gpu.csv"))
    ap.add_argument("--rank", action="store_true")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.rank:
        rank_main(args)
        return
    import torch

    devices = torch.cuda.device_count() or max(args.worlds)  # no CUDA: the CPU smoke test, any W
    rows, notes = [], []
    for world in args.worlds:
        if world > devices:
            notes.append(f"W={world} skipped: {devices} CUDA device(s), NCCL needs one per rank")
            print(notes[-1], flush=True)
            continue
        result = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--rank", "--result", result] + [
            a for k in ("family", "prompt_tokens", "group", "response_tokens", "chunk_size", "block", "hidden",
                        "layers") for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))] + (
            ["--exact"] if args.exact else [])
        subprocess.run(cmd, check=True)
        with open(result) as f:
            got = json.load(f)
        got.update(family=args.family, prompt_tokens=args.prompt_tokens, group=args.group,
                   response_tokens=args.response_tokens,
                   device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke test)")
        rows.append(got)
        print(f"W={world} capture {got['capture_s']:.3f} s  step {got['step_s']:.3f} s  loss {got['loss']:.6f}  "
              f"received {got['capture_bytes_received'] / 2**20:.1f} MiB (predicted "
              f"{got['capture_bytes_predicted'] / 2**20:.1f})  peak {got['peak_gib']:.2f} GiB"
              + (f"  exact step {got['exact_step_s']:.3f} s (walk {got['exact_walk_s']:.3f} s, received "
                 f"{got['walk_bytes_received'] / 2**20:.1f} MiB, predicted {got['walk_bytes_predicted'] / 2**20:.1f};"
                 f" grad norm {got['exact_grad_norm']:.6g})" if args.exact else ""), flush=True)
    if rows:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        new = not os.path.exists(args.out)
        with open(args.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    base = next((r for r in rows if r["world"] == 1), None)
    ratios = {f"W{r['world']}": {"capture": r["capture_s"] / base["capture_s"], "step": r["step_s"] / base["step_s"],
                                 "loss_rel_diff": abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12),
                                 "exact_step": r["exact_step_s"] / base["exact_step_s"],
                                 "grad_norm_rel_diff": abs(r["exact_grad_norm"] - base["exact_grad_norm"])
                                 / max(abs(base["exact_grad_norm"]), 1e-12)}
              for r in rows if base is not None and r["world"] > 1}
    # W > 1 must reproduce W = 1 within the dtype's rounding (bf16 on CUDA, fp32 on CPU)
    tol = 2e-2 if torch.cuda.is_available() else 1e-4
    agree = all(r["loss_rel_diff"] <= tol and not r["grad_norm_rel_diff"] > tol for r in ratios.values())
    print(json.dumps({"bench": "gpu_cp", "family": args.family, "prompt_tokens": args.prompt_tokens,
                      "ratios_to_W1": ratios, "notes": notes, "all_ok": bool(rows) and agree, "rows": rows}))


if __name__ == "__main__":
    main()
