"""GPU check: a Qwen3.6-27B-shaped stack (a few layers, bf16, random weights) at the
largest prompt that fits a time budget, next to the planner's prediction.

The physics: the stack has Qwen3.6-27B's real layer shapes (hidden 5120; attention 24
query heads over 4 KV heads of dim 256 with an output gate; Gated DeltaNet 16 QK heads and
48 V heads of dim 128, conv kernel 4; vocab 248,320) but only `--layers` layers in its 3
GDN : 1 attention pattern. Capture cost is dominated by the attention layers' O(P^2)
prompt attention (our blockwise torch kernel on CUDA); the state is the attention K/V
(4 KV heads x 256 x 2 x bf16 = 4 KiB per token per attention layer) plus a constant GDN
state. One detached GRPO step (G = 2 responses of R tokens) is run per P, doubling P
until the next size would exceed the time budget; peak memory is
`torch.cuda.max_memory_allocated` over the step (model loaded before the reset).

Machine: one NVIDIA H200 (lent by the session's device tool). Writes $OUT/gpu.json and
prints a table, then one JSON line.

    python3 bench/gpu/stack.py --layers 4 --budget-s 420
    python3 bench/gpu/stack.py --dry     # CPU smoke test with a tiny stack
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
from tests.reference import uniform_group  # noqa: E402

QWEN36 = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
              num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=False,
              rms_norm_eps=1e-6, attention_dropout=0.0)


def build(layers: int, dry: bool):
    import transformers

    fields = dict(QWEN36, num_hidden_layers=layers,
                  layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)])
    if dry:
        fields.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                      num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16)
    model_type = fields.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "sdpa"
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), config, fields


def planner(fields, model_type, P, G, R, chunk):
    from longstraw.plan import PlanConfig, estimate

    path = os.path.join(os.environ.get("OUT", "/tmp"), "stack_config.json")
    with open(path, "w") as f:
        json.dump({"model_type": model_type, **fields}, f)
    try:
        report = estimate(path, PlanConfig(prompt_tokens=P, group=G, response_tokens=R, chunk_size=chunk,
                                           dtype="bf16"))
        return {k: report[k] for k in ("peak_bytes_per_rank", "state_bytes_total", "estimated_time_s_detached")}
    except Exception as exc:  # noqa: BLE001 - the planner is informational here
        return {"error": repr(exc)}


def fused_check(dry: bool) -> dict:
    """On this device: the fused no-grad kernel against the blockwise kernel (bf16 on
    CUDA), and the blockwise kernel in bf16 against float32. Disables the fused path
    for the run if it disagrees."""
    import longstraw.ops.attention as A

    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(24, 300, 256, device=device, dtype=dtype, generator=g)
    k = torch.randn(4, 300, 256, device=device, dtype=dtype, generator=g)
    v = torch.randn(4, 300, 256, device=device, dtype=dtype, generator=g)
    pk = torch.randn(4, 5000, 256, device=device, dtype=dtype, generator=g)
    pv = torch.randn(4, 5000, 256, device=device, dtype=dtype, generator=g)
    kw = dict(prefixes=[A.KVSegment(pk, pv, 0)], q_start=5000, scale=256 ** -0.5, block_size=1024)
    with torch.no_grad():
        ref = A.prefix_causal_attention(q.float(), k.float(), v.float(), allow_fused=False,
                                        prefixes=[A.KVSegment(pk.float(), pv.float(), 0)], q_start=5000,
                                        scale=256 ** -0.5, block_size=1024)
        blockwise = A.prefix_causal_attention(q, k, v, allow_fused=False, **kw).float()
        out = {"blockwise_vs_fp32_maxerr": float((blockwise - ref).abs().max())}
        try:
            fused = A.prefix_causal_attention(q, k, v, **kw).float()
            out["fused_vs_fp32_maxerr"] = float((fused - ref).abs().max())
        except Exception as exc:  # noqa: BLE001 - reported, then the run goes on without it
            out["fused_error"] = repr(exc)[:300]
    if "fused_error" in out or out["fused_vs_fp32_maxerr"] > 4 * out["blockwise_vs_fp32_maxerr"] + 0.02:
        import longstraw.ops.flash as F

        F.FUSED_ENABLED = False
        out["fused_disabled"] = True
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--response-tokens", type=int, default=512)
    ap.add_argument("--chunk-size", type=int, default=8192)
    ap.add_argument("--start-tokens", type=int, default=65536)
    ap.add_argument("--max-tokens", type=int, default=4194304)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    t_start = time.perf_counter()
    checks = fused_check(args.dry)
    print("fused-vs-blockwise check:", json.dumps(checks), flush=True)
    model, config, fields = build(args.layers, args.dry)
    if args.dry:
        args.start_tokens, args.max_tokens, args.response_tokens, args.chunk_size = 256, 1024, 16, 128
    cuda = torch.cuda.is_available() and not args.dry
    rows, P, last = [], args.start_tokens, 0.0
    torch.backends.cuda.matmul.allow_tf32 = True  # the blockwise kernel's fp32 score matmuls (replay) on tensor cores
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=args.chunk_size, attention_block_size=4096,
                                            allow_position_overflow=True))
    while P <= args.max_tokens:
        # predicted next time ~ 4x (O(P^2) attention) of the last: stop before the budget runs out
        if rows and (time.perf_counter() - t_start) + 4.2 * last > args.budget_s:
            break
        group = uniform_group(config.vocab_size, P, args.group, args.response_tokens, seed=0)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        try:
            result = engine.step(group, ls.GRPOConfig())
        except torch.OutOfMemoryError as exc:
            rows.append({"prompt_tokens": P, "oom": str(exc)[:200]})
            break
        if cuda:
            torch.cuda.synchronize()
        last = time.perf_counter() - t0
        m = result.metrics
        row = {"prompt_tokens": P, "group": args.group, "response_tokens": args.response_tokens,
               "step_s": last, "capture_s": m["time_capture_s"], "replay_s": m["time_replay_s"],
               "state_bytes": m["state_bytes"],
               "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
               "model_bytes": base if cuda else None,
               "planner": planner(fields, "qwen3_5_text", P, args.group, args.response_tokens, args.chunk_size)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        model.zero_grad(set_to_none=True)
        P *= 2
    print(f"\n{'P':>9} {'step s':>8} {'capture s':>9} {'state GiB':>9} {'peak GiB':>9} {'planner GiB':>11}")
    for r in rows:
        if "oom" in r:
            print(f"{r['prompt_tokens']:>9} OOM")
            continue
        gib = lambda x: f"{x / 2**30:.2f}" if x else "-"  # noqa: E731
        print(f"{r['prompt_tokens']:>9} {r['step_s']:>8.1f} {r['capture_s']:>9.1f} {gib(r['state_bytes']):>9} "
              f"{gib(r['peak_bytes']):>9} {gib(r['planner'].get('peak_bytes_per_rank')):>11}")
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry)", "torch": torch.__version__,
           "fused_check": checks, "total_s": time.perf_counter() - t_start,
           "layers": args.layers, "dtype": "bfloat16" if cuda else "float32", "rows": rows}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu.json"), "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
