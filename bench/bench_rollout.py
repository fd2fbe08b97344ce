"""One GRPO iteration (generate G responses, then the update) on a tiny model, CPU fp32:
LongStraw with the capture reused, without it, and with HF's own generate.

The physics: a GRPO iteration needs the prompt's state twice, to sample the G responses
and to replay them with autograd. HF's `generate(num_return_sequences=G)` prefills the
prompt for every one of the G sequences (it expands the input before the prefill) and
keeps G copies of its cache; a separate update then captures the prompt again. LongStraw
captures it once: `engine.generate` decodes the G branches together against that one
state (each branch keeps only its own tokens), and `engine.step(group, state=...)`
replays them against the same state. So the prompt work of an iteration is one capture,
not G + 1 prefills (HF) or 2 captures (no reuse), and the peak during generation is the
state plus G small branch caches, flat in G.

Methods (`--methods`), each timed as one whole iteration in a fresh process:
* `reuse`: rollout = engine.generate(prompt, G, R); engine.step(group, state=rollout.state)
* `recapture`: the same generate, then engine.step(group) (a second capture)
* `hf_generate`: model.generate(prompt, num_return_sequences=G, do_sample=True,
  max_new_tokens=R) (HF's cache), then engine.step(group) (LongStraw's update)
* `generate`: engine.generate alone (for its peak against G)

Every branch runs the full R tokens (no eos), so every method does the same decoding.
Rewards are random (fixed seed). Measurement: a subprocess per row (`--worker`), 2 torch
threads (env BENCH_THREADS), model built first, then RSS read; `peak_above_model` = ru_maxrss - that RSS.
Rows are appended to `--out` (CSV); the driver prints a table with ratios against
`reuse` (same G) and ends with one JSON line.

Usage:
    .venv/bin/python bench/bench_rollout.py --prompt-tokens 32768 --groups 8 \\
        --methods reuse recapture hf_generate --out bench/results/rollout.csv
    .venv/bin/python bench/bench_rollout.py --prompt-tokens 32768 --groups 2 16 --methods generate \\
        --out bench/results/rollout.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.proc import code_info, cpu_model, mem_total, peak_rss, status_bytes, worker_row  # noqa: E402

FIELDS = ["family", "method", "prompt_tokens", "group", "response_tokens", "time_s", "time_generate_s",
          "time_update_s", "peak_above_model", "peak_generate_above_model", "state_bytes", "branch_state_bytes",
          "load_avg_1m", "threads", "cpu", "mem_total", "git_rev", "longstraw_dirty"]


def worker(args) -> dict:
    import torch

    import longstraw as ls
    from longstraw.tiny import tiny_model

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    model = tiny_model(args.family, dtype=torch.float32)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    rewards = torch.rand(args.group, generator=torch.Generator().manual_seed(1))
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=args.chunk_size))
    rss0 = status_bytes("VmRSS")
    gen = torch.Generator().manual_seed(2)
    t0 = time.perf_counter()
    state_bytes = branch_bytes = float("nan")
    if args.method == "hf_generate":
        config = model.generation_config
        config.eos_token_id = config.pad_token_id = model.config.eos_token_id = None
        with torch.no_grad():
            out = model.generate(prompt[None], do_sample=True, max_new_tokens=args.response_tokens, top_k=0,
                                 num_return_sequences=args.group)
        responses = list(out[:, args.prompt_tokens:])
        state = None
    else:
        rollout = engine.generate(prompt, num_samples=args.group, max_new_tokens=args.response_tokens,
                                  generator=gen)
        responses, state = rollout.responses, rollout.state
        state_bytes, branch_bytes = rollout.metrics["state_bytes"], rollout.metrics["branch_state_bytes"]
    t1 = time.perf_counter()
    peak_gen = peak_rss() - rss0
    if args.method != "generate":
        group = ls.Group(prompt=prompt, responses=responses, rewards=rewards)
        engine.step(group, state=state if args.method == "reuse" else None)
    t2 = time.perf_counter()
    assert all(r.numel() == args.response_tokens for r in responses)
    return dict(time_s=t2 - t0, time_generate_s=t1 - t0, time_update_s=t2 - t1, peak_above_model=peak_rss() - rss0,
                peak_generate_above_model=peak_gen, state_bytes=state_bytes, branch_state_bytes=branch_bytes)


def run_one(args, method: str, group: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--family", args.family, "--method", method,
           "--prompt-tokens", str(args.prompt_tokens), "--group", str(group), "--response-tokens",
           str(args.response_tokens), "--chunk-size", str(args.chunk_size)]
    row = worker_row(cmd)
    row.update(family=args.family, method=method, prompt_tokens=args.prompt_tokens, group=group,
               response_tokens=args.response_tokens, load_avg_1m=os.getloadavg()[0],
               threads=int(os.environ.get("BENCH_THREADS", "2")), cpu=cpu_model(),
               mem_total=mem_total(), **code_info(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, help=argparse.SUPPRESS)
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--methods", nargs="+", default=["reuse", "recapture", "hf_generate"])
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--groups", type=int, nargs="+", default=[8])
    p.add_argument("--response-tokens", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--out", default="bench/out/rollout.csv")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for group in args.groups:
        for method in args.methods:
            row = run_one(args, method, group)
            rows.append(row)
            print(f"{method:>12} G={group:<3} time {row['time_s']:8.2f} s (generate {row['time_generate_s']:7.2f}, "
                  f"update {row['time_update_s']:7.2f})  peak {row['peak_above_model'] / 2**20:8.1f} MiB "
                  f"(generate {row['peak_generate_above_model'] / 2**20:8.1f})  load {row['load_avg_1m']:.2f}",
                  file=sys.stderr)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    new = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in FIELDS})
    ratios = {}
    for row in rows:
        base = next((r for r in rows if r["method"] == "reuse" and r["group"] == row["group"]), None)
        if base is not None and row is not base:
            ratios[f"{row['method']}_G{row['group']}"] = {
                "reuse_time_over_this": base["time_s"] / row["time_s"],
                "reuse_peak_over_this": base["peak_above_model"] / row["peak_above_model"]}
    gens = {r["group"]: r for r in rows if r["method"] == "generate"}
    if len(gens) >= 2:
        lo, hi = min(gens), max(gens)
        ratios[f"generate_peak_G{hi}_over_G{lo}"] = (gens[hi]["peak_generate_above_model"]
                                                     / gens[lo]["peak_generate_above_model"])
    print(f"\n{'method':>12} {'G':>3} {'time s':>9} {'peak MiB':>9}")
    for row in rows:
        print(f"{row['method']:>12} {row['group']:>3} {row['time_s']:9.2f} {row['peak_above_model'] / 2**20:9.1f}")
    print(json.dumps({"rows": len(rows), "ratios": ratios}))


if __name__ == "__main__":
    main()
