"""GPU check of state offload (`ExecConfig(state_device="cpu")`): device peak flat in the
number of attention layers, step time against the on-device state, and the overlap of
the host<->device copies with compute.

The physics: a Qwen3.6-27B-shaped stack (bench/gpu/stack.py: hidden 5120, 24
query / 4 KV heads of dim 256, GDN 16 QK / 48 V heads, 3 GDN : 1 attention) holds 4 KiB of
K/V per prompt token per attention layer, so at P tokens each attention layer holds
P x 4 KiB (1 GiB at 256K). On the device that grows with the number of layers; offloaded,
the device holds two layers' rows (the running one and the prefetched next) whatever the
number of layers, and every pass moves every layer's rows over PCIe once:

    sweep 1  P fixed, layers growing: device peak above the weights, on-device vs
             offloaded, with the device capped at the weights + --slack-gib (10 GiB): the
             on-device state of the deeper stacks does not fit (more attention layers than
             fit without offload); the offloaded peak stays flat.
    sweep 2  a P where both fit: step time on-device vs offloaded, and the overlap
             achieved: 1 - (t_offload - t_device) / t_copy, t_copy = the step's bytes
             moved (the stager's counts) / the pinned copy bandwidth measured here.
             1 = every copy hidden behind compute; 0 = none.

Detached GRPO steps, G responses of R tokens, bf16, random weights. Peak =
torch.cuda.max_memory_allocated over the step minus the bytes allocated before it
(the model). Writes $OUT/gpu_offload.json, prints a table, then one JSON line.

    python3 bench/gpu/offload.py                       # H200: ~10 minutes
    python3 bench/gpu/offload.py --cpu                 # CPU smoke test on tiny shapes

Not run on a GPU yet (no GPU machine was lent to the session that wrote it): the README
and docs/offload.md quote the planner's figures, planned, not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import longstraw as ls  # noqa: E402
from bench.gpu.stack import build  # noqa: E402
from tests.reference import uniform_group  # noqa: E402

GiB = 2 ** 30


def copy_bandwidth(cuda: bool, nbytes: int) -> float:
    """Pinned host -> device (and back) copy bandwidth, B/s, the mean of both directions."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    times = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / 3)
    return nbytes / (sum(times) / 2)


def step(model, config, P: int, args, offload: bool, cuda: bool) -> dict:
    """One detached step; peak above what was allocated before it (the model)."""
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=args.chunk_size, attention_block_size=args.block,
                                            allow_position_overflow=True,
                                            state_device="cpu" if offload else None))
    group = uniform_group(config.vocab_size, P, args.group, args.response_tokens, seed=0)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    try:
        m = engine.step(group).metrics
    except torch.OutOfMemoryError as exc:
        return {"oom": str(exc)[:160]}
    if cuda:
        torch.cuda.synchronize()
    out = {"step_s": time.perf_counter() - t0, "state_bytes": m["state_bytes"],
           "peak_above_model": (torch.cuda.max_memory_allocated() - base) if cuda else None,
           "h2d_bytes": m.get("offload_h2d_bytes", 0.0), "d2h_bytes": m.get("offload_d2h_bytes", 0.0),
           "slot_bytes": m.get("offload_slot_bytes", 0.0)}
    model.zero_grad(set_to_none=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=262144, help="sweep 1's P (1 GiB K/V per attention layer)")
    ap.add_argument("--layers", default="8,16,32,48", help="sweep 1's stack depths (a quarter are attention)")
    ap.add_argument("--slack-gib", type=float, default=10.0,
                    help="device memory a step may use above the model's weights (GiB; a per-process cap): at "
                         "the default P the on-device state of 40+ layers (10+ attention layers) does not fit it")
    ap.add_argument("--time-tokens", type=int, default=65536, help="sweep 2's P (both fit)")
    ap.add_argument("--time-layers", type=int, default=16)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--response-tokens", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=16384)
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--cpu", action="store_true", help="smoke test on CPU with tiny shapes (float32)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if args.cpu:
        args.prompt_tokens, args.time_tokens, args.layers, args.time_layers = 200, 160, "4,8,12", 8
        args.response_tokens, args.chunk_size, args.block = 8, 64, 32
    depths = [int(x) for x in args.layers.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = True
    t_start = time.perf_counter()
    bandwidth = copy_bandwidth(cuda, GiB if cuda else 8 << 20)
    print(f"pinned copy bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)

    # ---- sweep 1: device peak vs depth at fixed P
    sweep = []
    for layers in depths:
        model, config, _ = build(layers, dry=args.cpu)
        row = {"layers": layers, "attention_layers": sum((i + 1) % 4 == 0 for i in range(layers)),
               "prompt_tokens": args.prompt_tokens}
        if cuda:  # the weights plus --slack-gib: the state that does not fit there must live elsewhere
            row["model_bytes"] = torch.cuda.memory_allocated()
            row["cap_bytes"] = row["model_bytes"] + args.slack_gib * GiB
            torch.cuda.set_per_process_memory_fraction(
                min(1.0, row["cap_bytes"] / torch.cuda.get_device_properties(0).total_memory))
        for offload in (False, True):
            row["offload" if offload else "device"] = step(model, config, args.prompt_tokens, args, offload, cuda)
        sweep.append(row)
        print(json.dumps(row), flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0)

    # ---- sweep 2: step time where both fit
    model, config, _ = build(args.time_layers, dry=args.cpu)
    timing = {"layers": args.time_layers, "prompt_tokens": args.time_tokens}
    for offload in (False, True, False, True):  # twice each: the first of each warms up
        timing["offload" if offload else "device"] = step(model, config, args.time_tokens, args, offload, cuda)
    dev, off = timing["device"], timing["offload"]
    moved = off["h2d_bytes"] + off["d2h_bytes"]
    t_copy = moved / bandwidth
    timing["copy_s"] = t_copy
    timing["slowdown"] = off["step_s"] / dev["step_s"]
    timing["overlap"] = max(0.0, min(1.0, 1 - (off["step_s"] - dev["step_s"]) / t_copy)) if t_copy else None

    unit, scale = ("GiB", GiB) if cuda else ("KiB", 1024)  # tiny shapes on CPU
    gib = lambda x: "-" if x is None else f"{x / scale:.2f}"  # noqa: E731
    print(f"\nsweep 1: P = {args.prompt_tokens:,}, device peak above the weights ({unit}; no device peak on CPU)")
    print(f"{'layers':>6} {'attn':>4} {'on-device':>10} {'offloaded':>10} {'state':>8} {'slots':>8}")
    for r in sweep:
        d, o = r["device"], r["offload"]
        print(f"{r['layers']:>6} {r['attention_layers']:>4} {'OOM' if 'oom' in d else gib(d['peak_above_model']):>10} "
              f"{'OOM' if 'oom' in o else gib(o['peak_above_model']):>10} "
              f"{gib(o.get('state_bytes')):>8} {gib(o.get('slot_bytes')):>8}")
    print(f"\nsweep 2: P = {args.time_tokens:,}, {args.time_layers} layers: on-device {dev['step_s']:.2f} s, "
          f"offloaded {off['step_s']:.2f} s ({timing['slowdown']:.2f}x), {moved / 1e9:.1f} GB moved = "
          f"{t_copy:.2f} s of copies, overlap {timing['overlap'] if timing['overlap'] is None else round(timing['overlap'], 3)}")
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu (smoke test, tiny shapes)",
           "torch": torch.__version__, "dtype": "bfloat16" if cuda else "float32",
           "copy_bandwidth_Bps": bandwidth, "slack_gib": args.slack_gib, "sweep": sweep, "timing": timing,
           "total_s": time.perf_counter() - t_start}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_offload.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
