"""Recurrent hybrids on CPU, float32: a tiny Nemotron-H-shaped model (Mamba2 + one
attention block + MLP / MoE blocks) and a tiny Kimi-Linear-shaped one (KDA + one NoPE
MLA layer + MoE), at P = 32,768, every measurement in a fresh subprocess.

The physics: most layers of these models keep a state that does not grow with P (an
SSM state [H, P, N] or a KDA state [H, Dk, Dv], plus a conv tail), so LongStraw's
captured prompt state is small, and replaying G branches against it keeps one
branch's graph alive. The naive per-branch path (one full-sequence HF forward +
backward per branch) keeps the whole prompt's activations with autograd instead.

Methods (one worker process each):
* `hf_forward`: HF's own no-grad forward of prompt[:-1] (`model.model(ids,
  use_cache=False)`, its torch fallbacks: no mamba-ssm / fla / causal-conv1d here).
* `capture`: `Engine(model, ExecConfig(chunk_size=4096)).capture(prompt)`, no grad.
* `detached`: `engine.step(group)`: capture + G replays with autograd.
* `naive`: per branch `tests.reference.hf_full_logprobs` over prompt + response, its
  share of the DAPO loss (`reference_grpo_loss`), backward, free.

Per row: wall time, peak RSS above the model (ru_maxrss - RSS after building the
model and group), the captured state's bytes (capture) and the K/V a dense-attention
equivalent would keep (every layer holding what the model's attention layer keeps per
token: K/V rows for Nemotron-H, MLA latent rows for Kimi Linear), and the 1-minute load
average before and after (the machine is shared: only ratios within one run mean
anything). Rows go to `--out` (CSV); the driver prints a table and ends with one JSON
line of the ratios.

Rows are appended to `--out`. A worker that dies (HF's own Kimi Linear forward at P =
32,768 is killed for memory here: its MLA layer's dense scores) is recorded with its
status and the ratios that need it are null.

Usage (the committed rows):
    .venv/bin/python bench/bench_recurrent.py --models nemotron_h
    .venv/bin/python bench/bench_recurrent.py --models kimi_linear
    .venv/bin/python bench/bench_recurrent.py --models kimi_linear --prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench.proc import cpu_model, peak_rss, status_bytes  # noqa: E402  (torch-free)

MODELS = ("nemotron_h", "kimi_linear")
METHODS = ("hf_forward", "capture", "detached", "naive")


def _model(name):
    from tests.reference import tiny_kimi, tiny_mamba
    import torch

    if name == "nemotron_h":  # SSD chunks of 128 as the published models (the tests use 8)
        return tiny_mamba("nemotron_h", dtype=torch.float32, chunk_size=128, max_position_embeddings=1 << 17)
    return tiny_kimi(dtype=torch.float32, max_position_embeddings=1 << 17)


def dense_equivalent_bytes(model, positions: int) -> int:
    """What every token-mixer layer would keep for `positions` tokens if each held the
    model's own attention-layer state per token (float32). Nemotron-H's MLP / MoE blocks
    mix no tokens and are not counted."""
    cfg = model.config
    if cfg.model_type == "kimi_linear":
        per_token, mixers = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.num_hidden_layers  # one latent row
    else:
        per_token = 2 * cfg.num_key_value_heads * cfg.head_dim  # K and V
        mixers = sum(t not in ("mlp", "moe") for t in cfg.layers_block_type)
    return mixers * per_token * positions * 4


def worker(args) -> None:
    import torch

    import longstraw as ls
    from tests.reference import hf_full_logprobs, reference_grpo_loss, uniform_group

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model = _model(args.model)
    group = uniform_group(model.config.vocab_size, args.prompt_tokens, args.group, args.response_tokens, seed=0)
    import gc

    gc.collect()
    base = status_bytes("VmRSS")
    row = dict(model=args.model, method=args.method, P=args.prompt_tokens, G=args.group, R=args.response_tokens,
               load_before=os.getloadavg()[0])
    t0 = time.perf_counter()
    if args.method == "hf_forward":
        with torch.no_grad():
            model.model(group.prompt[:-1][None], use_cache=False)
    elif args.method == "capture":
        state = ls.Engine(model, ls.ExecConfig(chunk_size=4096)).capture(group.prompt)
        row["state_bytes"] = state.nbytes()
        row["dense_equivalent_kv_bytes"] = dense_equivalent_bytes(model, args.prompt_tokens - 1)
    elif args.method == "detached":
        ls.Engine(model, ls.ExecConfig(chunk_size=4096)).step(group)
    else:  # naive: one full sequence per branch, its share of the group's DAPO loss, backward
        r = group.rewards.double()
        adv = (r - r.mean()) / (r.std() + 1e-4)  # the group's advantages, as the engine computes them
        total = sum(x.numel() for x in group.responses)
        for i, response in enumerate(group.responses):
            one = ls.Group(prompt=group.prompt, responses=[response], rewards=None, advantages=adv[i:i + 1])
            loss = reference_grpo_loss([hf_full_logprobs(model, group.prompt, response)], one, num_tokens=total)
            loss.backward()
            del loss
    row["time_s"] = time.perf_counter() - t0
    row["peak_above_model_bytes"] = peak_rss() - base
    row["load_after"] = os.getloadavg()[0]
    print("ROW " + json.dumps(row))


def _ratio(by, a, b, key):
    """by[a][key] / by[b][key], or None where either measurement failed."""
    if a not in by or b not in by or key not in by[a] or key not in by[b]:
        return None
    return by[a][key] / by[b][key]


def driver(args) -> None:
    rows = []
    for model in args.models:
        for method in args.methods:
            cmd = [sys.executable, __file__, "--worker", "--model", model, "--method", method,
                   "--prompt-tokens", str(args.prompt_tokens), "--group", str(args.group),
                   "--response-tokens", str(args.response_tokens)]
            load = os.getloadavg()[0]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": REPO})
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")), None)
            if line is None:  # recorded, not fatal: e.g. HF's dense MLA scores at 32K exceed the machine's RAM
                why = "killed (SIGKILL: out of memory)" if out.returncode in (-9, 137) else f"rc={out.returncode}"
                row = dict(model=model, method=method, P=args.prompt_tokens, G=args.group, R=args.response_tokens,
                           load_before=load, status=why)
                print(f"{model:12s} {method:11s} {why}", flush=True)
            else:
                row = {**json.loads(line[4:]), "status": "ok"}
                print(f"{model:12s} {method:11s} {row['time_s']:8.2f} s  peak above model "
                      f"{row['peak_above_model_bytes'] / 2**20:9.1f} MiB  load {row['load_before']:.1f}->"
                      f"{row['load_after']:.1f}", flush=True)
            row["cpu"] = cpu_model()
            row["threads"] = int(os.environ.get("BENCH_THREADS", "1"))
            rows.append(row)
            _append(args.out, row)
    summary = {}
    for model in args.models:
        by = {r["method"]: r for r in rows if r["model"] == model and r["status"] == "ok"}
        summary[model] = {
            "capture_over_hf_forward_time": _ratio(by, "capture", "hf_forward", "time_s"),
            "naive_over_detached_peak_above_model": _ratio(by, "naive", "detached", "peak_above_model_bytes"),
            "naive_over_detached_time": _ratio(by, "naive", "detached", "time_s"),
            "dense_kv_over_state": _ratio(by, "capture", "capture", "dense_equivalent_kv_bytes")
            and by["capture"]["dense_equivalent_kv_bytes"] / by["capture"]["state_bytes"],
        }
    print(json.dumps({"bench": "recurrent", "P": args.prompt_tokens, "G": args.group, "R": args.response_tokens,
                      "dtype": "float32", "threads": int(os.environ.get("BENCH_THREADS", "1")), "ratios": summary}))


FIELDS = ("model", "method", "P", "G", "R", "status", "time_s", "peak_above_model_bytes", "state_bytes",
          "dense_equivalent_kv_bytes", "load_before", "load_after", "threads", "cpu")


def _append(path: str, row: dict) -> None:
    """Append one row to the CSV at `path` (header first when new)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerow({k: row.get(k, "") for k in FIELDS})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--method", choices=METHODS)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "recurrent_cpu.csv"))
    args = p.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
