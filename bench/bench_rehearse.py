"""Rehearsal against the planner: Qwen3.6-27B (the preset, text model, bf16), one rank,
G = 8 responses of R = 8,192 tokens in pieces of 2,048, chunks of 4,096, detached, at
each prompt length P given.

A rehearsal (`ls.rehearse`) runs the engine's own step on fake tensors: nothing is
computed or allocated, so its wall time and RSS are the cost of *walking the code* at
that size (dispatch per op: O(P / chunk_size x layers) ops), not of the step. Its
peak per phase is the live tensor bytes the step holds. The planner (`longstraw plan`)
estimates the same peak analytically; its static memory includes the optimizer state,
which a rehearsal without `optimizer=True` does not hold, so the planner's figures are
compared without it (peak - optimizer_bytes; a phase: static - optimizer + its working set).
Each P runs in a fresh process (its own peak RSS). `--group G --response-tokens R`
rehearse a smaller group (rows that isolate capture's growth with P; the paper's G = 8,
R = 8,192 replay alone dispatches ~2M ops at 64 layers, see docs/rehearse.md). Each row
records the ops the tracker saw (`ops`): a rehearsal's wall time is about ops x the cost
of one fake dispatch.

    PYTHONPATH=. python bench/bench_rehearse.py 16384 65536
    PYTHONPATH=. python bench/bench_rehearse.py --group 1 --response-tokens 2048 16384 65536
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROWS = "bench/results/rehearse_qwen36_27b.jsonl"
PRESET = "qwen3.6-27b"
G, R, PIECE, CHUNK = 8, 8192, 2048, 4096


def planner(P: int, G: int = G, R: int = R, mode: str = "detached") -> dict:
    from longstraw.plan.config import PlanConfig
    from longstraw.plan.estimate import estimate

    r = estimate(PRESET, PlanConfig(prompt_tokens=P, group=G, response_tokens=R, branch_chunk_size=PIECE,
                                    chunk_size=CHUNK, mode=mode, gpus=1, grads_during_capture=False))
    opt = r["optimizer_bytes"]
    phases = {k: v - opt for k, v in r["breakdown"]["phase_peak_bytes"].items()}  # static + working, less optimizer
    return {"peak_bytes_per_rank": r["peak_bytes_per_rank"] - opt, "phases": phases,
            "capture_working_bytes": r["capture_working_bytes"], "replay_working_bytes": r["replay_working_bytes"],
            "static_wo_optimizer": r["static_bytes_per_rank"] - opt, "optimizer_bytes": opt}


def one(P: int, G: int = G, R: int = R, mode: str = "detached") -> dict:
    import torch
    import transformers

    import longstraw as ls
    from longstraw.measure import peak_rss_bytes
    from longstraw.plan.arch import load_model_config

    _, cfg, _ = load_model_config(PRESET)
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    hf = transformers.AutoConfig.for_model("qwen3_5_text", **fields)
    t0, c0 = time.perf_counter(), time.process_time()
    # the paper runs P + R past the preset's 262,144 positions (max_position_embeddings): allowed, as there
    config = ls.ExecConfig(chunk_size=CHUNK, mode=mode, branch_chunk_size=PIECE, allow_position_overflow=True)
    r = ls.rehearse(hf, config, prompt_tokens=P, group=G, response_tokens=R, device="cpu", dtype=torch.bfloat16)
    return {"P": P, "G": G, "R": R, "piece": PIECE, "chunk": CHUNK, "rehearsal": r.as_dict(),
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "load_avg_1m": os.getloadavg()[0], "peak_rss_bytes": peak_rss_bytes(), "planner": planner(P, G, R, mode), "mode": mode}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print(json.dumps(one(*map(int, argv[1:4]), *argv[4:5])))  # --one P G R [mode]
        return
    g, r = G, R
    while argv[:1] in (["--group"], ["--response-tokens"]):
        g, r = (int(argv[1]), r) if argv[0] == "--group" else (g, int(argv[1]))
        argv = argv[2:]
    gib = 2 ** 30
    print(f"{'P':>9} {'phase':>8} {'planner GiB':>12} {'rehearsal GiB':>14} {'ratio':>6} {'wall s':>7} {'RSS GiB':>8}")
    for P in map(int, argv):
        out = subprocess.run([sys.executable, __file__, "--one", str(P), str(g), str(r)], capture_output=True,
                             text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        with open(ROWS, "a") as f:
            f.write(json.dumps(row) + "\n")
        reh, plan = row["rehearsal"], row["planner"]
        pairs = [("peak", plan["peak_bytes_per_rank"], reh["peak_bytes_per_rank"])]
        pairs += [(k, plan["phases"].get({"walk": "recompute"}.get(k, k)), v) for k, v in reh["phases"].items()]
        for name, p, q in pairs:
            ratio = f"{q / p:6.3f}" if p else "   n/a"
            print(f"{P:>9} {name:>8} {(p or 0) / gib:12.2f} {q / gib:14.2f} {ratio} {row['wall_s']:7.1f} "
                  f"{row['peak_rss_bytes'] / gib:8.2f}")
        print(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1:])
