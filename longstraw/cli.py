"""The `longstraw` command. Thin: it parses flags and calls the library.

    longstraw demo [--prompt-tokens 32768] [--group 8] [--response-tokens 256]
                   [--chunk-size 4096] [--mode detached] [--family qwen3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import sys


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def demo(args) -> int:
    import torch

    import longstraw as ls
    from longstraw.memory import naive_bytes_per_token, peak_rss_bytes, rss_bytes
    from longstraw.tiny import random_group, tiny_model

    torch.manual_seed(args.seed)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    model = tiny_model(args.family, dtype=dtype, seed=args.seed)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    group = random_group(vocab, args.prompt_tokens, args.group, args.response_tokens, seed=args.seed)
    print(f"LongStraw demo: tiny {args.family} ({n_params / 1e6:.1f}M params, {args.dtype}), "
          f"P={args.prompt_tokens:,}, G={args.group}, R={args.response_tokens}, "
          f"chunk={args.chunk_size}, mode={args.mode}", file=sys.stderr)
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=args.chunk_size, mode=args.mode, progress=True))
    rss_model = rss_bytes()
    result = engine.step(group, ls.GRPOConfig())
    peak_above = peak_rss_bytes() - rss_model
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    per_token = naive_bytes_per_token(model, vocab)
    naive_branch = per_token * (args.prompt_tokens + args.response_tokens)
    m = result.metrics
    rows = [
        ("loss (0 on-policy when all R_i are equal)", f"{result.loss:.6f}"),
        ("gradient norm", f"{float(grad_norm):.4e}"),
        ("prompt state", _mib(m["state_bytes"])),
        ("peak RSS above loaded model", _mib(peak_above)),
        ("time: capture", f"{m['time_capture_s']:.2f} s"),
        ("time: replay (all branches)", f"{m['time_replay_s']:.2f} s"),
        ("naive graph, one full sequence*", _mib(naive_branch)),
        ("naive graph, G sequences batched*", _mib(naive_branch * args.group)),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    print(f"\n  * naive = HF forward+backward over P+R tokens; activation bytes saved for backward, measured\n"
          f"    at 256 and 512 tokens ({per_token / 1024:.1f} KiB/token) and extrapolated linearly.")
    print(json.dumps({"loss": result.loss, "peak_rss_above_model": peak_above,
                      "naive_bytes_per_token": per_token, **m}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="longstraw", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="one GRPO step on a tiny built-in model (no download)")
    p.add_argument("--prompt-tokens", type=int, default=32768, help="P (default 32768)")
    p.add_argument("--group", type=int, default=8, help="G responses (default 8)")
    p.add_argument("--response-tokens", type=int, default=256, help="R per response (default 256)")
    p.add_argument("--chunk-size", type=int, default=4096, help="capture chunk (default 4096)")
    p.add_argument("--mode", default="detached", choices=["detached", "exact"])
    p.add_argument("--family", default="qwen3", help="tiny model family (default qwen3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from longstraw.errors import LongStrawError

    try:
        return demo(args)
    except LongStrawError as exc:
        print(f"longstraw: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
