"""Screenshot-heavy prompts on the tiny VLM (issue 39): one GRPO step, CPU, float32,
LongStraw's two modes against the naive full-sequence path, each in a fresh subprocess.

The physics
-----------
An agent's trajectory is mostly screenshots: N images of T tokens each between short
text turns, P tokens in all. LongStraw runs the vision tower once per image at capture
(no grad), places the merged rows at the image tokens and captures the prompt in chunks;
its state is what the text model keeps (the tiny Qwen3.5's 3 GDN layers: constant; its
attention layer: K, V per token), plus the N x T image rows themselves (the walk reads
them back). Exact mode's reverse walk sums dLoss/d(image rows) and then runs each
image's tower once more with autograd: one image's graph at a time. The naive path
(what TRL does, one sequence at a time) runs HF's forward + backward over prompt +
response for each of the G branches, the tower over every image included: its graph
grows with P and its work with G * P.

Methods (`--methods`): `detached`, `exact` (`ExecConfig(mode=..., chunk_size=C)`), and
`naive` (per branch: `tests.vision_reference.hf_vlm_full_logprobs` with grad, its share
of the DAPO loss, backward, free).

Measurement (as bench/bench_step.py, simpler): each method runs in its own subprocess
(`--worker`), torch.set_num_threads(BENCH_THREADS, default 1). The worker builds
`longstraw.tiny.tiny_vlm()` (float32), the prompt (`longstraw.tiny_vision.screenshot_prompt`: N images of a
(1, 2a, 2b) grid, a * b = T, each between vision start / end tokens, text filling the
rest) and G random responses of R tokens, reads RSS, runs the step (perf_counter), reads
the peak RSS: `peak_above_model` = peak - RSS after building. `state_bytes` is the
step's metric (exact: the gradient buffers added, `state_grad_bytes`);
`dense_equivalent_bytes` is what a dense model of the same layer count and K/V shape
would keep: K and V of every layer for every prompt position. Rows append to `--out`
(CSV, with the machine); the driver prints a table with ratios to `naive` and ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["method", "prompt_tokens", "images", "image_tokens", "group", "response_tokens", "chunk_size", "time_s",
          "peak_above_model_bytes", "state_bytes", "state_grad_bytes", "dense_equivalent_bytes", "loss", "machine",
          "threads"]


def worker(args) -> dict:
    import time

    import torch

    sys.path.insert(0, ROOT)
    import longstraw as ls
    from longstraw.measure import peak_rss_bytes, rss_bytes, without_hf_kernel_fallback_warning
    from longstraw.tiny import tiny_vlm
    from longstraw.tiny_vision import screenshot_prompt
    from tests.reference import reference_grpo_loss
    from tests.vision_reference import hf_vlm_full_logprobs

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    model = tiny_vlm()
    prompt, inputs = screenshot_prompt(args.prompt_tokens, args.images, args.image_tokens)
    g = torch.Generator().manual_seed(1)
    responses = [torch.randint(0, 4000, (args.response_tokens,), generator=g) for _ in range(args.group)]
    group = ls.Group(prompt=prompt, responses=responses, rewards=torch.arange(args.group, dtype=torch.float32),
                     prompt_inputs=inputs)
    text = model.config.text_config
    attention = sum(t == "full_attention" for t in text.layer_types)
    dense = 2 * text.num_key_value_heads * text.head_dim * text.num_hidden_layers * (prompt.numel() - 1) * 4
    before = rss_bytes()
    t0 = time.perf_counter()
    metrics, loss = {}, 0.0
    with without_hf_kernel_fallback_warning():
        if args.method == "naive":  # bench_step.naive_step with the pixels: branch i live in slot i
            kept = []
            for i in range(args.group):
                logp = hf_vlm_full_logprobs(model, prompt, responses[i], inputs)  # (R,) with graph
                slots = [logp if j == i else torch.zeros(r.shape) for j, r in enumerate(responses)]
                reference_grpo_loss(slots, group).backward()
                kept.append(logp.detach())
                del logp, slots
            with torch.no_grad():
                loss = float(reference_grpo_loss(kept, group))
        else:
            result = ls.Engine(model, ls.ExecConfig(mode=args.method, chunk_size=args.chunk_size)).step(group)
            metrics, loss = result.metrics, result.loss
    elapsed = time.perf_counter() - t0
    assert attention >= 1
    return dict(method=args.method, prompt_tokens=prompt.numel(), images=args.images, image_tokens=args.image_tokens,
                group=args.group, response_tokens=args.response_tokens, chunk_size=args.chunk_size,
                time_s=round(elapsed, 3), peak_above_model_bytes=max(0, peak_rss_bytes() - before),
                state_bytes=int(metrics.get("state_bytes", 0)), state_grad_bytes=int(metrics.get("state_grad_bytes", 0)),
                dense_equivalent_bytes=dense, loss=loss, machine=f"{platform.machine()} {os.cpu_count()} cpus",
                threads=int(os.environ.get("BENCH_THREADS", "1")))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--image-tokens", type=int, default=512)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--response-tokens", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--methods", default="detached,exact,naive")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "vision_cpu.csv"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = []
    for method in args.methods.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--method", method] + [
            f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
            ("prompt_tokens", "images", "image_tokens", "group", "response_tokens", "chunk_size")]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    new = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)
    base = next((r for r in rows if r["method"] == "naive"), None)
    gib = 2 ** 30
    print(f"P={args.prompt_tokens} images={args.images}x{args.image_tokens} G={args.group} R={args.response_tokens} "
          f"chunk={args.chunk_size} float32 CPU threads={os.environ.get('BENCH_THREADS', '1')}")
    print(f"{'method':10s} {'time s':>8s} {'x naive':>8s} {'peak GiB':>9s} {'x naive':>8s} {'state MiB':>10s} "
          f"{'dense-equiv MiB':>16s}")
    for r in rows:
        t = r["time_s"] / base["time_s"] if base else float("nan")
        m = r["peak_above_model_bytes"] / base["peak_above_model_bytes"] if base else float("nan")
        print(f"{r['method']:10s} {r['time_s']:8.2f} {t:8.2f} {r['peak_above_model_bytes'] / gib:9.3f} {m:8.2f} "
              f"{r['state_bytes'] / 2 ** 20:10.2f} {r['dense_equivalent_bytes'] / 2 ** 20:16.2f}")
    print(json.dumps({"bench": "vision", "rows": rows}))


if __name__ == "__main__":
    main()
