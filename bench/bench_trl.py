"""Stock `trl.GRPOTrainer` against `LongStrawGRPOTrainer`: one optimizer step of a TRL
training run on the same tiny model and data, CPU, float32, each P in a fresh process.

The physics
-----------
Stock TRL generates G completions with HF `generate` over a batch of G copies of the
prompt, then runs one batched full-sequence forward + backward over G x (P + R) tokens
(with TRL's defaults: gradient checkpointing on, chunked fused lm_head): its memory grows
with G x P. LongStrawGRPOTrainer captures the prompt once (`engine.generate`: capture,
then G branches decode against the one state), and its update replays the G branches one
at a time against that same state (`engine.step`): memory is parameters + state + one
branch's graph (exact mode: + state gradients + one chunk's graph), flat in G, linear in
P only through the state (2 x kv_heads x head_dim x layers floats per token).

Methods: `trl` (stock GRPOTrainer, TRL's defaults), `longstraw` (detached, chunk 4096),
`longstraw_exact` (exact mode, chunk `--exact-chunk-size`). Same model (`longstraw.tiny`
qwen3 preset: 4 layers, hidden 256, GQA 4/2 heads of 32, vocab 4096; positions raised to
4M), same single random prompt, G, R = max_completion_length, one step of SGD.

Measurement (bench_step.py's conventions)
-----------------------------------------
Each (method, P) is one subprocess (`--worker`, torch threads 2): build model, tokenizer,
dataset and trainer, read RSS (`rss_after_setup`), reset the peak (`/proc/self/clear_refs`
5: VmHWM := current RSS), `trainer.train()` for one step, then `peak_above_setup` =
VmHWM - rss_after_setup and `step_time_s` = TRL's logged `step_time` (generation + loss +
backward of the step). The driver never imports torch; it polls each worker's RSS and kills
it above `--kill-rss-gib` (the fixed memory cap) or after `--timeout-s`. Per method, P
doubles from `--min-prompt-tokens` until a worker is killed or fails, or P passes
`--max-prompt-tokens`: the last P that finished is that method's largest P under the cap.

Each measurement appends one CSV row to `--out`; the driver prints a table, the TRL /
LongStraw ratios of peak and step time at every P both ran, the largest P per method and
their ratio, and ends with one JSON line.

Usage:
    .venv/bin/python bench/bench_trl.py --kill-rss-gib 4 --out bench/results/trl_vs_longstraw.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import _read_csv, machine_info, run_worker  # noqa: E402  (torch-free)
from proc import status_bytes  # noqa: E402

METHODS = ("trl", "longstraw", "longstraw_exact")
THREADS = 2
VOCAB = 4096
MIB, GIB = 2**20, 2**30
FIELDS = ["method", "P", "G", "R", "status", "rss_after_setup", "peak_above_setup", "step_time_s", "loss",
          "state_bytes", "state_grad_bytes", "captures", "time_capture_s", "time_generate_s", "time_replay_s",
          "time_reverse_s", "kill_rss_gib", "chunk_size", "cpu", "threads", "torch", "transformers", "trl",
          "git_rev", "longstraw_dirty", "timestamp"]


# ============================================================================
# worker (one measurement, fresh process)


def worker(args) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    import datasets
    import trl

    import longstraw as ls
    from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer
    from longstraw.tiny import tiny_model

    P, G, R = args.worker_p, args.groups, args.response_tokens
    model = tiny_model("qwen3", dtype=torch.float32, max_position_embeddings=1 << 22)
    g = torch.Generator().manual_seed(0)
    prompt = " ".join(map(str, torch.randint(2, VOCAB, (P,), generator=g).tolist()))
    dataset = datasets.Dataset.from_dict({"prompt": [prompt]})

    def reward(completion_ids, **kwargs):
        return [sum(t % 2 for t in c) / len(c) for c in completion_ids]

    config = trl.GRPOConfig(output_dir=os.path.join("/tmp", f"bench_trl_{os.getpid()}"),
                            per_device_train_batch_size=G, num_generations=G, max_completion_length=R, max_steps=1,
                            learning_rate=1e-6, optim="sgd", use_cpu=True, bf16=False, report_to=[],
                            save_strategy="no", logging_steps=1, seed=0)
    kwargs = dict(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                  processing_class=token_id_tokenizer(VOCAB, eos_token_id=1))
    if args.worker_method == "trl":
        trainer = trl.GRPOTrainer(**kwargs)
    else:
        exact = args.worker_method == "longstraw_exact"
        exec_cfg = ls.ExecConfig(mode="exact" if exact else "detached",
                                 chunk_size=args.exact_chunk_size if exact else args.chunk_size)
        trainer = LongStrawGRPOTrainer(**kwargs, longstraw_config=exec_cfg)
    del prompt
    import gc

    gc.collect()
    rss_after_setup = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := current RSS
        f.write("5")
    trainer.train()
    peak = status_bytes("VmHWM")
    log = next(h for h in trainer.state.log_history if "loss" in h)
    return {"method": args.worker_method, "P": P, "G": G, "R": R, "status": "ok",
            "rss_after_setup": rss_after_setup, "peak_above_setup": peak - rss_after_setup,
            "step_time_s": log["step_time"], "loss": log["loss"],
            **{k: log.get(f"longstraw/{k}") for k in ("state_bytes", "state_grad_bytes", "captures", "time_capture_s",
                                                      "time_generate_s", "time_replay_s", "time_reverse_s")}}


# ============================================================================
# driver (no torch here)


def sweep(args, method: str, info: dict) -> list[dict]:
    rows, P = [], args.min_prompt_tokens
    while P <= args.max_prompt_tokens:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--worker-method", method, "--worker-p", str(P),
               "--groups", str(args.groups), "--response-tokens", str(args.response_tokens),
               "--chunk-size", str(args.chunk_size), "--exact-chunk-size", str(args.exact_chunk_size)]
        t0 = time.time()
        status, out, err = run_worker(cmd, args.timeout_s, int(args.kill_rss_gib * GIB))
        row = {"method": method, "P": P, "G": args.groups, "R": args.response_tokens, "status": status}
        if status == "ok":
            try:
                row = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                row["status"] = "failed: no result line"
        if row["status"].startswith("failed"):  # the worker's last words
            tail = err.strip().splitlines()[-1:] if err.strip() else []
            row["status"] = f"{row['status']} {tail[0][:160] if tail else ''}".strip()
        row.update(kill_rss_gib=args.kill_rss_gib, chunk_size=args.exact_chunk_size if method.endswith("exact")
                   else args.chunk_size, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), **info)
        _append_csv_rows(args.out, row)
        rows.append(row)
        peak = row.get("peak_above_setup")
        print(f"{method:16s} P={P:>8d}  {row['status'][:60]:60s}  "
              f"peak {peak / MIB if peak else float('nan'):8.0f} MiB  step {row.get('step_time_s') or float('nan'):7.2f} s"
              f"  (wall {time.time() - t0:.0f} s)", flush=True)
        if row["status"] != "ok":
            break
        P *= 2
    return rows


def _append_csv_rows(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def summarize(rows: list[dict], kill_gib: float) -> dict:
    ok = {}
    for r in rows:
        if r["status"] == "ok":
            ok.setdefault(r["method"], {})[int(r["P"])] = r
    largest = {m: max(ps) if ps else 0 for m, ps in ok.items()}
    last = {r["method"]: r for r in rows}  # a sweep that ended on an ok row stopped at --max-prompt-tokens
    bounded = {m: last[m]["status"] == "ok" for m in largest}
    print("\nratios TRL / LongStraw at the same P (peak above setup, step time):")
    ratios = {}
    for m in ("longstraw", "longstraw_exact"):
        for P in sorted(set(ok.get("trl", {})) & set(ok.get(m, {}))):
            t, s = ok["trl"][P], ok[m][P]
            peak_ratio = float(t["peak_above_setup"]) / max(1.0, float(s["peak_above_setup"]))
            time_ratio = float(t["step_time_s"]) / float(s["step_time_s"])
            ratios.setdefault(m, {})[P] = {"peak": round(peak_ratio, 2), "time": round(time_ratio, 2)}
            print(f"  {m:16s} P={P:>8d}  peak {peak_ratio:6.2f}x  step time {time_ratio:6.2f}x")
    print(f"\nlargest P under {kill_gib:g} GiB: " + ", ".join(
        f"{m} {'>= ' if bounded[m] else ''}{p}" + (" (the sweep's end, not the cap)" if bounded[m] else "")
        for m, p in largest.items()))
    trl_p = largest.get("trl", 0)
    reach = {m: round(p / trl_p, 1) for m, p in largest.items() if m != "trl" and trl_p}
    for m, x in reach.items():
        print(f"  {m}: {x}x TRL's largest P")
    return {"largest_P": largest, "reached_sweep_end": bounded, "largest_P_vs_trl": reach,
            "ratios_trl_over_longstraw": ratios,
            "kill_rss_gib": kill_gib}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--groups", type=int, default=4, help="G = num_generations")
    ap.add_argument("--response-tokens", type=int, default=32, help="R = max_completion_length")
    ap.add_argument("--min-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-prompt-tokens", type=int, default=1 << 19)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--exact-chunk-size", type=int, default=1024)
    ap.add_argument("--kill-rss-gib", type=float, default=4.0, help="the memory cap: a worker above it is killed")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "trl_vs_longstraw.csv"))
    ap.add_argument("--summary-only", action="store_true", help="summarize the rows already in --out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-method", help=argparse.SUPPRESS)
    ap.add_argument("--worker-p", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from importlib.metadata import version

    os.environ["OMP_NUM_THREADS"] = str(THREADS)

    info = {k: v for k, v in machine_info().items() if k in FIELDS}
    info["trl"] = version("trl")
    info["threads"] = THREADS
    print(f"machine: {info.get('cpu')}, torch threads {THREADS}; tiny qwen3 fp32, G={args.groups}, "
          f"R={args.response_tokens}, cap {args.kill_rss_gib:g} GiB", flush=True)
    rows = [] if args.summary_only else [r for m in args.methods for r in sweep(args, m, info)]
    if args.summary_only:
        rows = _read_csv(args.out)
    print(json.dumps(summarize(rows, args.kill_rss_gib)))


if __name__ == "__main__":
    main()
