"""Peak memory and step time of one GRPO step: LongStraw (detached mode) vs the naive
Hugging Face full-sequence path, on a tiny dense (Qwen3-shaped) model, on CPU.

The physics
-----------
One GRPO group is a shared prompt of P tokens and G responses of R tokens each.

* naive: for each of the G branches, one full-sequence forward over the P + R tokens
  of prompt + response with autograd (`tests.reference.hf_full_logprobs`, the model's
  own SDPA attention), that branch's share of the DAPO loss, backward, free the graph.
  Every branch re-runs the whole prompt, forward and backward: time ~ 3 * G * cost(P),
  and the autograd graph holds every layer's activations for P + R positions, so
  activation memory grows linearly with P (it does not grow with G, since one branch's
  graph is freed before the next).
* LongStraw (`Engine.step`, detached mode): capture runs the prompt once, forward only,
  under no_grad, in chunks of `chunk_size`, and keeps only the per-layer K/V of the
  P - 1 prompt positions (here 4 layers x 2 KV heads x 32 dims x {K, V} x fp32 = 2 KiB
  per position, 16 MiB at P = 8192). Each branch then replays R tokens with autograd
  against that read-only state and is freed before the next. Peak memory is
  grads + state + one chunk of capture working memory + one R-token branch graph:
  independent of G, and only the small state grows with P. Time ~ cost(P) + G * cost(R
  tokens against P keys).

Both paths accumulate the gradient into `.grad`, so both pay for the parameter grads.
The two gradients are NOT expected to be identical: the naive full-sequence gradient
also flows through the prompt's K/V ("exact"), the detached one does not. The script
reports their cosine similarity for information only; exactness of LongStraw against HF
is covered by the test suite (`tests/test_engine_hf.py`, HF's cached continuation).

Measurement
-----------
Machine: CPU only, `torch.set_num_threads(2)` (the dev box has 2 cores). dtype float32.
Model: `longstraw.tiny.tiny_model("qwen3")` (4 layers, hidden 256, 4 query heads over 2
KV heads of dim 32, vocab 4096, ~4.6M parameters, ~18 MiB fp32).
Group: `longstraw.tiny.random_group(4096, P, G, R, seed=0)`.
Defaults: P = 8192, R = 128, G in {2, 8}; `--quick`: P = 1024, R = 32.

Every (method, G) runs in a fresh subprocess (`--worker`), so peak RSS is clean:
build model and group, `gc.collect()`, read current RSS (`rss_after_model`), run the
step (timed with `time.perf_counter`), then read the process's peak RSS
(`ru_maxrss`). `peak_above_model = peak_rss - rss_after_model`. The worker also reads
`ru_maxrss` right before the step: if the process had already peaked higher while
importing/building (so the step's own peak is hidden), the row is flagged.

glibc note: RSS is what the OS sees, not what torch's CPU allocator holds. Large blocks
(above glibc's mmap threshold, 128 KiB growing dynamically up to 32 MiB) are mmapped and
returned on free; smaller ones come from malloc arenas that may retain freed pages.
Retention can only make a later allocation reuse memory, so peak RSS is an upper bound of
the true live-tensor peak plus allocator slack, for both methods alike. The environment
is left as is (no MALLOC_* tuning).

Usage:
    .venv/bin/python bench/bench_dense.py                 # full size, a few minutes
    .venv/bin/python bench/bench_dense.py --quick         # smoke run
    .venv/bin/python bench/bench_dense.py --groups 2 8 --prompt-tokens 8192 --response-tokens 128
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `tests.reference` (the naive baseline) and `longstraw`

METHODS = ("longstraw", "naive")
THREADS = 2
VOCAB = 4096
MIB = 2**20

# Targets (see the module docstring for the physics behind them).
TARGET_PEAK_RATIO = 10.0  # naive / LongStraw peak above model, at each G
TARGET_G_FLAT = 1.02  # LongStraw peak(G=max) <= 1.02 * peak(G=min)
TARGET_TIME_RATIO = 10.0  # naive / LongStraw step time at the largest G


# ----------------------------------------------------------------------------
# worker: one (method, G) in a fresh process


def _current_rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is in the venv
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _naive_step(model, group, grpo):
    """G full-sequence forwards + backwards, one branch at a time (graph freed between).

    Branch i's share of the group loss is `reference_grpo_loss` itself (TRL's formula,
    from the tests) evaluated with branch i's live log-probs in slot i and constant
    placeholders in the other slots: the advantages are still those of the whole group,
    the divisor is the whole group's token count, and only slot i carries a gradient, so
    its backward is exactly branch i's share of d(group loss). Returns the group loss.
    """
    import torch

    from tests.reference import hf_full_logprobs, reference_grpo_loss

    num_tokens = group.response_tokens
    kept = []
    for i, response in enumerate(group.responses):
        logp = hf_full_logprobs(model, group.prompt, response, grpo.temperature)  # (R,) with graph
        slots = [logp if j == i else torch.zeros(r.numel(), dtype=logp.dtype) for j, r in enumerate(group.responses)]
        loss_i = reference_grpo_loss(slots, group, loss_type=grpo.loss_type, epsilon_low=grpo.epsilon_low,
                                     epsilon_high=grpo.epsilon_high, num_tokens=num_tokens)
        loss_i.backward()
        kept.append(logp.detach())
        del logp, slots, loss_i  # free this branch's graph before the next one
    with torch.no_grad():
        loss = reference_grpo_loss(kept, group, loss_type=grpo.loss_type, epsilon_low=grpo.epsilon_low,
                                   epsilon_high=grpo.epsilon_high, num_tokens=num_tokens)
    return float(loss), {}


def _longstraw_step(model, group, grpo, exec_kwargs):
    import longstraw as ls

    result = ls.Engine(model, ls.ExecConfig(**exec_kwargs)).step(group, grpo)
    return result.loss, result.metrics


def worker(args) -> dict:
    import gc
    import time

    import torch

    torch.set_num_threads(THREADS)
    import longstraw as ls
    from longstraw.tiny import random_group, tiny_model

    model = tiny_model("qwen3", dtype=torch.float32)
    group = random_group(VOCAB, args.prompt_tokens, args.worker_g, args.response_tokens, seed=0)
    grpo = ls.GRPOConfig()
    exec_kwargs = dict(chunk_size=args.chunk_size, attention_block_size=args.attention_block_size,
                       logits_chunk_size=args.logits_chunk_size)
    gc.collect()
    rss_after_model = _current_rss()
    peak_before_step = _peak_rss()

    t0 = time.perf_counter()
    if args.worker_method == "naive":
        loss, metrics = _naive_step(model, group, grpo)
    else:
        loss, metrics = _longstraw_step(model, group, grpo, exec_kwargs)
    step_time = time.perf_counter() - t0
    peak_rss = _peak_rss()
    rss_after_step = _current_rss()

    if args.grad_out:
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        torch.save(flat, args.grad_out)
    params = sum(p.numel() for p in model.parameters())
    return {
        "method": args.worker_method,
        "G": args.worker_g,
        "P": args.prompt_tokens,
        "R": args.response_tokens,
        "dtype": "float32",
        "params": params,
        "param_bytes": params * 4,
        "rss_after_model": rss_after_model,
        "peak_before_step": peak_before_step,
        "peak_rss": peak_rss,
        "rss_after_step": rss_after_step,
        "peak_above_model": peak_rss - rss_after_model,
        "baseline_hid_peak": peak_before_step >= peak_rss,
        "step_time_s": step_time,
        "time_capture_s": metrics.get("time_capture_s"),
        "time_replay_s": metrics.get("time_replay_s"),
        "state_bytes": metrics.get("state_bytes"),
        "loss": loss,
        "exec_config": exec_kwargs if args.worker_method == "longstraw" else None,
    }


# ----------------------------------------------------------------------------
# driver


def run_one(method: str, g: int, args, grad_out: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--worker-method", method, "--worker-g", str(g),
           "--prompt-tokens", str(args.prompt_tokens), "--response-tokens", str(args.response_tokens),
           "--chunk-size", str(args.chunk_size), "--attention-block-size", str(args.attention_block_size),
           "--logits-chunk-size", str(args.logits_chunk_size)]
    if grad_out:
        cmd += ["--grad-out", grad_out]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"worker {method} G={g} failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


def grad_agreement(path_a: str, path_b: str) -> dict:
    import torch

    a, b = torch.load(path_a).double(), torch.load(path_b).double()
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "rel_diff": float((a - b).norm() / b.norm()),
        "norm_ratio": float(a.norm() / b.norm()),
    }


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "nproc": os.cpu_count(), "cpu": cpu, "threads": THREADS}


def _status(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=None, help="P (default 8192; 1024 with --quick)")
    p.add_argument("--response-tokens", type=int, default=None, help="R (default 128; 32 with --quick)")
    p.add_argument("--groups", type=int, nargs="+", default=[2, 8], help="group sizes G (default: 2 8)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "out", "dense.csv"), help="CSV of the rows")
    p.add_argument("--quick", action="store_true", help="smoke run: P=1024, R=32")
    p.add_argument("--no-grad-check", action="store_true", help="skip the naive-vs-LongStraw gradient comparison")
    # LongStraw's public ExecConfig knobs (defaults: ExecConfig's own)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--attention-block-size", type=int, default=1024)
    p.add_argument("--logits-chunk-size", type=int, default=1024)
    # internal
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--worker-g", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grad-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prompt_tokens is None:
        args.prompt_tokens = 1024 if args.quick else 8192
    if args.response_tokens is None:
        args.response_tokens = 32 if args.quick else 128

    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    groups = sorted(set(args.groups))
    P, R = args.prompt_tokens, args.response_tokens
    info = machine_info()
    print(f"LongStraw vs naive HF full-sequence GRPO step | tiny qwen3, float32, CPU x{THREADS} threads "
          f"(nproc={info['nproc']}, {info['cpu']}), torch {info['torch']}")
    print(f"P={P} R={R} G={groups} | LongStraw ExecConfig(chunk_size={args.chunk_size}, "
          f"attention_block_size={args.attention_block_size}, logits_chunk_size={args.logits_chunk_size})")
    print("each row runs in a fresh subprocess ...", flush=True)

    rows, agreement = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for g in groups:
            paths = {}
            for method in METHODS:
                paths[method] = None if args.no_grad_check else os.path.join(tmp, f"{method}-{g}.pt")
                row = run_one(method, g, args, paths[method])
                rows.append(row)
                print(f"  {method:9s} G={g:<3d} peak above model {row['peak_above_model'] / MIB:9.1f} MiB  "
                      f"step {row['step_time_s']:8.2f} s", flush=True)
            if not args.no_grad_check:
                agreement[g] = grad_agreement(paths["longstraw"], paths["naive"])

    by = {(r["method"], r["G"]): r for r in rows}
    g_lo, g_hi = groups[0], groups[-1]
    peak_ratio = {g: by["naive", g]["peak_above_model"] / by["longstraw", g]["peak_above_model"] for g in groups}
    ls_flat = by["longstraw", g_hi]["peak_above_model"] / by["longstraw", g_lo]["peak_above_model"]
    time_ratio = {g: by["naive", g]["step_time_s"] / by["longstraw", g]["step_time_s"] for g in groups}

    # ---------------------------------------------------------------- table
    print()
    hdr = (f"{'method':10s} {'G':>3s} {'RSS model':>10s} {'peak RSS':>10s} {'peak above model':>17s} "
           f"{'state':>9s} {'step time':>10s} {'capture':>8s} {'replay':>8s}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        state = f"{r['state_bytes'] / MIB:7.1f} M" if r["state_bytes"] else f"{'-':>9s}"
        cap = f"{r['time_capture_s']:7.2f}s" if r["time_capture_s"] is not None else f"{'-':>8s}"
        rep = f"{r['time_replay_s']:7.2f}s" if r["time_replay_s"] is not None else f"{'-':>8s}"
        flag = "  (!) process peaked before the step" if r["baseline_hid_peak"] else ""
        print(f"{r['method']:10s} {r['G']:3d} {r['rss_after_model'] / MIB:8.1f} M {r['peak_rss'] / MIB:8.1f} M "
              f"{r['peak_above_model'] / MIB:13.1f} MiB {state} {r['step_time_s']:9.2f}s {cap} {rep}{flag}")
    print()
    for g in groups:
        print(f"naive / LongStraw peak above model, G={g}: {peak_ratio[g]:7.2f}x   "
              f"[target >= {TARGET_PEAK_RATIO:g}x: {_status(peak_ratio[g] >= TARGET_PEAK_RATIO)}]")
    print(f"LongStraw peak above model, G={g_hi} / G={g_lo}: {ls_flat:7.3f}   "
          f"[target <= {TARGET_G_FLAT:g}: {_status(ls_flat <= TARGET_G_FLAT)}]")
    for g in groups:
        target = f"   [target >= {TARGET_TIME_RATIO:g}x: {_status(time_ratio[g] >= TARGET_TIME_RATIO)}]" if g == g_hi else ""
        print(f"naive / LongStraw step time, G={g}: {time_ratio[g]:7.2f}x{target}")
    for g, a in agreement.items():
        print(f"grad agreement G={g} (detached vs full-sequence gradient, not expected to be equal): "
              f"cosine {a['cosine']:.4f}, ||ls - naive|| / ||naive|| = {a['rel_diff']:.3e}, "
              f"norm ratio {a['norm_ratio']:.4f}")

    # ---------------------------------------------------------------- CSV
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fields = ["method", "G", "P", "R", "dtype", "params", "param_bytes", "rss_after_model", "peak_before_step",
              "peak_rss", "rss_after_step", "peak_above_model", "baseline_hid_peak", "step_time_s", "time_capture_s",
              "time_replay_s", "state_bytes", "loss"]
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"\nrows written to {os.path.relpath(out, os.getcwd())}")

    targets = {
        "peak_ratio_ge_10": {str(g): peak_ratio[g] >= TARGET_PEAK_RATIO for g in groups},
        "longstraw_g_flat_le_1.02": ls_flat <= TARGET_G_FLAT,
        "time_ratio_ge_10_at_max_g": time_ratio[g_hi] >= TARGET_TIME_RATIO,
    }
    summary = {
        "bench": "dense", "machine": info, "dtype": "float32", "model": "longstraw.tiny.tiny_model('qwen3')",
        "sizes": {"P": P, "R": R, "G": groups},
        "exec_config": {"chunk_size": args.chunk_size, "attention_block_size": args.attention_block_size,
                        "logits_chunk_size": args.logits_chunk_size},
        "rows": rows,
        "ratios": {"naive_over_longstraw_peak_above_model": {str(g): v for g, v in peak_ratio.items()},
                   f"longstraw_peak_G{g_hi}_over_G{g_lo}": ls_flat,
                   "naive_over_longstraw_step_time": {str(g): v for g, v in time_ratio.items()}},
        "grad_agreement": {str(g): a for g, a in agreement.items()},
        "targets": targets,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
