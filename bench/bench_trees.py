"""Prefix trees (issue 26): one `Engine.step` on a group whose responses share segments,
with `share_response_prefixes=True` (tree) against False (flat), on the tiny hybrid, CPU
float32, 1 thread per process, every arm in a fresh subprocess.

Cases (`--cases`)
-----------------
* `fork`: G = 8 responses share one 2,048-token segment, then 256 tokens each. Flat
  replays 8 x 2,304 tokens with autograd; the tree runs the segment once (capture, then
  its reverse walk: a forward more than a flat token's) and 8 x 256.
* `tree3`: a three-level tree of 2 x 4 x 2 = 16 leaves: 2 segments of 1,024, 4 of 512
  below each, 2 of 128 below each of those (responses of 1,664 tokens). Flat: 16 x 1,664
  = 26,624 tokens; the floor is the sum of the segments' tokens, 8,192 (0.31 of flat).
* `none`: nothing shared (8 random responses of 2,304 tokens): the tree is the flat
  path plus building the trie; `trie_s` times `build_trie` alone in the same process.

Both arms see the same model, prompt and responses (P = `--prompt-tokens`), and capture
the prompt inside the step (its cost is in both). Times: the step's own phase clocks
(`time_capture_s`, `time_replay_s`, `time_total_s`, wall) and `step_cpu_s`, the step's
CPU-seconds (one thread: on a machine shared with other work this is the steadier
measure; wall time there moves with the load, `load_avg_1m`). Memory: `peak_above_model` =
ru_maxrss at the end - VmRSS after building the model and the group.

Usage:
    .venv/bin/python bench/bench_trees.py --prompt-tokens 16384 --out bench/results/trees_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc import machine_row, own_cpu_s, peak_rss, status_bytes, worker_row  # noqa: E402  (torch-free)

FIELDS = ["case", "arm", "mode", "family", "prompt_tokens", "group", "response_tokens", "replay_tokens",
          "shared_segments", "floor_tokens", "time_total_s", "time_capture_s", "time_replay_s", "time_reverse_s",
          "trie_s", "step_cpu_s", "rss_after_model", "peak_rss", "peak_above_model", "loss", "cpu_time_s", "threads",
          "load_avg_1m", "cpu", "mem_total", "git_rev", "longstraw_dirty", "when"]


def tree_responses(fanouts, lengths, vocab, gen):
    """Responses of a tree: `fanouts[k]` children per node at level k, each a fresh random
    segment of `lengths[k]` tokens; returns (the leaves' responses, the segments' tokens)."""
    import torch

    paths = [torch.zeros(0, dtype=torch.long)]
    for fan, n in zip(fanouts, lengths):
        paths = [torch.cat([p, torch.randint(0, vocab, (n,), generator=gen)]) for p in paths for _ in range(fan)]
    floor, nodes = 0, 1
    for fan, n in zip(fanouts, lengths):
        nodes *= fan
        floor += nodes * n
    return paths, floor


CASES = {
    "fork": ((1, 8), (2048, 256)),
    "tree3": ((2, 4, 2), (1024, 512, 128)),
    "none": ((8,), (2304,)),
}


def worker(args) -> dict:
    import torch

    import longstraw as ls
    from longstraw.engine.trie import build_trie
    from longstraw.tiny import tiny_model

    torch.set_num_threads(args.threads)
    model = tiny_model(args.family, dtype=torch.float32)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen)
    responses, floor = tree_responses(*CASES[args.case], vocab, gen)
    rewards = torch.rand(len(responses), generator=torch.Generator().manual_seed(1))
    group = ls.Group(prompt=prompt, responses=responses, rewards=rewards)
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=args.chunk_size, mode=args.mode,
                                            share_response_prefixes=args.arm == "tree"))
    rss0 = status_bytes("VmRSS")
    trie = []
    for _ in range(5):
        t0 = time.perf_counter()
        build_trie(group.responses)
        trie.append(time.perf_counter() - t0)
    c0 = time.process_time()
    m = engine.step(group).metrics
    step_cpu = time.process_time() - c0
    return dict(group=len(responses), response_tokens=group.response_tokens, replay_tokens=m["replay_tokens"],
                shared_segments=m["shared_segments"], floor_tokens=floor, time_total_s=m["time_total_s"],
                time_capture_s=m["time_capture_s"], time_replay_s=m["time_replay_s"],
                time_reverse_s=m["time_reverse_s"], trie_s=min(trie), step_cpu_s=step_cpu, rss_after_model=rss0,
                peak_rss=peak_rss(),
                peak_above_model=peak_rss() - rss0, cpu_time_s=own_cpu_s())


def run_one(args, case: str, arm: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--case", case, "--arm", arm, "--mode", args.mode,
           "--family", args.family, "--prompt-tokens", str(args.prompt_tokens), "--chunk-size", str(args.chunk_size),
           "--threads", str(args.threads)]
    row = worker_row(cmd)
    row.update(case=case, arm=arm, mode=args.mode, family=args.family, prompt_tokens=args.prompt_tokens,
               threads=args.threads, **machine_row(REPO))
    return row


def ratios_of(rows) -> dict:
    """Same-run ratios per case: tree / flat step time, replay time and peak; tree3's
    replay tokens against the floor; none's trie time against its step."""
    out = {}
    by = {(r["case"], r["arm"]): r for r in rows}
    for case in {r["case"] for r in rows}:
        tree, flat = by.get((case, "tree")), by.get((case, "flat"))
        if tree is None or flat is None:
            continue
        out[f"{case}_time_tree_over_flat"] = tree["time_total_s"] / flat["time_total_s"]
        out[f"{case}_replay_time_tree_over_flat"] = tree["time_replay_s"] / flat["time_replay_s"]
        if tree.get("step_cpu_s") and flat.get("step_cpu_s"):  # CPU-seconds: less sensitive to a loaded machine
            out[f"{case}_step_cpu_tree_over_flat"] = tree["step_cpu_s"] / flat["step_cpu_s"]
        out[f"{case}_peak_tree_over_flat"] = tree["peak_above_model"] / flat["peak_above_model"]
        out[f"{case}_floor_tokens_over_flat_tokens"] = tree["floor_tokens"] / flat["response_tokens"]
        out[f"{case}_trie_s_over_tree_step"] = tree["trie_s"] / tree["time_total_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--cases", nargs="+", default=list(CASES))
    p.add_argument("--mode", default="detached")
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/out/trees.csv")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for case in args.cases:
        for arm in ("flat", "tree"):
            row = run_one(args, case, arm)
            rows.append(row)
            print(f"{case:>6} {arm:>5} {row['time_total_s']:8.2f} s (capture {row['time_capture_s']:6.2f}, replay "
                  f"{row['time_replay_s']:7.2f})  tokens {row['replay_tokens']:>7.0f}  peak "
                  f"{row['peak_above_model'] / 2**20:7.1f} MiB  load {row['load_avg_1m']:.2f}", file=sys.stderr,
                  flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    new = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in FIELDS})
    print(f"\n{'case':>6} {'arm':>5} {'total s':>8} {'capt s':>7} {'replay s':>8} {'cpu s':>7} {'tokens':>7} "
          f"{'floor':>6} {'trie ms':>8} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['case']:>6} {r['arm']:>5} {r['time_total_s']:8.2f} {r['time_capture_s']:7.2f} "
              f"{r['time_replay_s']:8.2f} {r['step_cpu_s']:7.2f} {r['replay_tokens']:7.0f} {r['floor_tokens']:6} "
              f"{r['trie_s'] * 1e3:8.2f} "
              f"{r['peak_above_model'] / 2**20:9.1f}")
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "mode": args.mode, "family": args.family,
                      "rows": len(rows), "ratios": ratios_of(rows)}))


if __name__ == "__main__":
    main()
