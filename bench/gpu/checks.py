"""GPU check of the paths CPU CI cannot reach: context parallelism over NCCL, bf16 exact
mode, and the autocast refusal. Prints a table and ends with one JSON line.

    python bench/gpu/checks.py          # one GPU: NCCL process group of world_size 1
    python bench/gpu/checks.py --cpu    # the same code paths on CPU over gloo (float32 for
                                       # the CP check, a tiny bf16 model for exact mode)

Checks (each a row):
1. cp_nccl: Engine(context_parallel=True) over a 1-rank NCCL group (every collective, the
   fingerprint included, must carry CUDA tensors) equals the single-process step, float32.
2. bf16_exact: bf16 exact-mode gradient vs float64 on the same weights: norm-wise relative
   error per parameter <= 16 u (u = 2^-8; the bound is derived in
   tests/engine/test_exact.py::test_bf16_exact_mode_sums_state_gradients_in_float32).
3. autocast_refused: a step under torch.autocast raises ConfigError before any work.
4. generate_greedy: float32 greedy `engine.generate` (3 branches) equals HF's greedy
   `generate` token for token (fraction of mismatched tokens, limit 0).
5. generate_bf16_cp: bf16 sampled rollout under context parallelism (the decode attention's
   fused kernel on CUDA, the NCCL broadcast of the sampled tokens): the rollout's
   log-probs against `score(group, state=rollout.state)` (max abs diff, limit 0.05).
6. kernel_selection: on this device the fused kernel is chosen where it applies (bf16,
   D = 128) and the blockwise one where it does not (D = 12): both run, and agree with
   float32 (max abs diff, limit 0.05).
7. offload_exact: exact mode with the state offloaded to host memory (one pinned arena per
   state, `cudaHostRegister` on CUDA) against the on-device state, float32 (gradient
   relative error, limit 1e-5).
Phase times come from `metrics` (CUDA-synchronized).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import longstraw as ls  # noqa: E402
from tests.reference import grads_of, random_group, tiny_model  # noqa: E402


def _rel(got: dict, want: dict) -> float:
    worst = 0.0
    for name, w in want.items():
        if w is None:
            continue
        worst = max(worst, float((got[name].double() - w.double()).norm() / w.double().norm().clamp_min(1e-300)))
    return worst


def check_cp(device: torch.device) -> dict:
    model = tiny_model("qwen3", dtype=torch.float32).to(device)
    group = random_group(97, 200, [17, 9, 30], seed=1)
    kw = dict(chunk_size=64, attention_block_size=32, mode="exact")
    model.zero_grad(set_to_none=True)
    single = ls.Engine(model, ls.ExecConfig(**kw)).step(group)
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    cp = ls.Engine(model, ls.ExecConfig(context_parallel=True, **kw)).step(group)
    return {"check": "cp_nccl" if device.type == "cuda" else "cp_gloo", "rel_err": _rel(grads_of(model), want),
            "limit": 1e-4, "time_s": cp.metrics["time_total_s"], "loss_diff": abs(cp.loss - single.loss)}


def check_bf16_exact(device: torch.device) -> dict:
    k = 64 if device.type == "cpu" else 320
    model = tiny_model("llama", dtype=torch.bfloat16, num_hidden_layers=1).to(device)
    prompt = torch.tensor([20, 21, 22, 23, 24, 3])
    group = ls.Group(prompt=prompt, responses=[torch.tensor([5])] * k + [torch.tensor([11])] * k,
                     rewards=torch.tensor([1.0] * k + [0.0] * k, dtype=torch.float64))

    def rows(m):
        m.zero_grad(set_to_none=True)
        result = ls.Engine(m, ls.ExecConfig(mode="exact", chunk_size=8)).step(group)
        return m.model.embed_tokens.weight.grad[prompt[:-1].to(device)].double(), result

    got, result = rows(model)
    want, _ = rows(model.double())
    err = float((got - want).norm() / want.norm())
    return {"check": "bf16_exact", "rel_err": err, "limit": 16 * 2.0 ** -8, "time_s": result.metrics["time_total_s"]}


def check_autocast(device: torch.device) -> dict:
    model = tiny_model("llama", dtype=torch.float32).to(device)
    group = random_group(97, 9, [3, 2], seed=1)
    t0 = time.perf_counter()
    refused = False
    with torch.autocast(device.type, dtype=torch.bfloat16):
        try:
            ls.Engine(model, ls.ExecConfig(chunk_size=4)).step(group)
        except ls.ConfigError:
            refused = True
    untouched = all(p.grad is None for p in model.parameters())
    return {"check": "autocast_refused", "rel_err": 0.0 if refused and untouched else 1.0, "limit": 0.5,
            "time_s": time.perf_counter() - t0}


def check_generate_greedy(device: torch.device) -> dict:
    model = tiny_model("qwen3", dtype=torch.float32).to(device)
    prompt = random_group(97, 300, [1], seed=2).prompt
    t0 = time.perf_counter()
    rollout = ls.Engine(model, ls.ExecConfig(chunk_size=64)).generate(prompt, num_samples=3, max_new_tokens=24,
                                                                      temperature=0)
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    with torch.no_grad():
        hf = model.generate(prompt[None].to(device), max_new_tokens=24, do_sample=False)[0, prompt.numel():]
    wrong = sum(int((r.to(device) != hf).sum()) for r in rollout.responses) / (3 * 24)
    return {"check": "generate_greedy", "rel_err": wrong, "limit": 0.0, "time_s": time.perf_counter() - t0}


def check_generate_bf16_cp(device: torch.device) -> dict:
    model = tiny_model("qwen3", dtype=torch.bfloat16).to(device)
    prompt = random_group(97, 300, [1], seed=3).prompt
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=64, context_parallel=True))
    t0 = time.perf_counter()
    rollout = engine.generate(prompt, num_samples=4, max_new_tokens=16,
                              generator=torch.Generator(device=device).manual_seed(0))
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.rand(4))
    scores = engine.score(group, state=rollout.state)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(scores, rollout.logprobs))
    return {"check": "generate_bf16_cp", "rel_err": diff, "limit": 0.05, "time_s": time.perf_counter() - t0}


def check_kernel_selection(device: torch.device) -> dict:
    from longstraw.ops import attention as A
    from longstraw.ops.flash import kernel_for

    dtype = torch.bfloat16
    t0 = time.perf_counter()
    worst, chosen = 0.0, {}
    for d in (128, 12):
        chosen[d] = kernel_for(device, d, d, dtype)
        g = torch.Generator(device=device).manual_seed(d)
        q, k, v = (torch.randn(h, 64, d, device=device, dtype=dtype, generator=g) for h in (4, 2, 2))
        pk, pv = (torch.randn(2, 200, d, device=device, dtype=dtype, generator=g) for _ in range(2))
        with torch.no_grad():
            got = A.prefix_causal_attention(q, k, v, prefixes=[A.KVSegment(pk, pv, 0)], q_start=200,
                                            scale=d ** -0.5, block_size=64).float()
            ref = A.prefix_causal_attention(q.float(), k.float(), v.float(), allow_fused=False,
                                            prefixes=[A.KVSegment(pk.float(), pv.float(), 0)], q_start=200,
                                            scale=d ** -0.5, block_size=64)
        worst = max(worst, float((got - ref).abs().max()))
    want = {128: "flash", 12: "blockwise" if device.type == "cuda" else "flash"}
    return {"check": "kernel_selection", "rel_err": worst if chosen == want else float("inf"), "limit": 0.05,
            "time_s": time.perf_counter() - t0, "chosen": {str(d): c for d, c in chosen.items()}}


def check_offload_exact(device: torch.device) -> dict:
    model = tiny_model("qwen3", dtype=torch.float32).to(device)
    group = random_group(97, 200, [17, 9], seed=4)
    kw = dict(chunk_size=64, attention_block_size=32, mode="exact")
    model.zero_grad(set_to_none=True)
    ls.Engine(model, ls.ExecConfig(**kw)).step(group)
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, ls.ExecConfig(state_device="cpu", **kw)).step(group)
    return {"check": "offload_exact", "rel_err": _rel(grads_of(model), want), "limit": 1e-5,
            "time_s": result.metrics["time_total_s"]}


def run_checks(doc: str, checks, header, figure: str = "rel_err") -> int:
    """The main of this script and of `bench/gpu/features.py` (`doc` the script's docstring,
    its first line the `--help` description): `--cpu` parsed, a 1-rank
    process group (NCCL on CUDA, gloo on CPU), each check run on the device as a row (one
    that raises is reported as a failed row and the rest still run), the table printed
    (`header(name, rows, use_cuda)` its first line, `figure` its figure column), then one
    JSON line; 0 when every row is ok, else 1."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU over gloo (no GPU needed)")
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    init = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=f"file://{init}", rank=0, world_size=1)
    rows = []
    try:
        for check in checks:
            try:
                row = check(device)
                row["ok"] = row["rel_err"] <= row["limit"]
            except Exception as exc:  # report, keep going
                row = {"check": check.__name__.removeprefix("check_"), "ok": False,
                       "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
    finally:
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if use_cuda else "cpu"
    print(header(name, rows, use_cuda))
    print(f"{'check':<18} {'ok':<5} {figure:>10} {'limit':>10} {'time_s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['check']:<18} {'NO':<5} {r['error']}")
        else:
            print(f"{r['check']:<18} {'yes' if r['ok'] else 'NO':<5} {r['rel_err']:>10.3e} {r['limit']:>10.3e} "
                  f"{r['time_s']:>8.2f}")
    print(json.dumps({"device": name, "torch": torch.__version__, "all_ok": all(r["ok"] for r in rows),
                      "rows": rows}))
    return 0 if all(r["ok"] for r in rows) else 1


def main() -> int:
    checks = (check_cp, check_bf16_exact, check_autocast, check_generate_greedy, check_generate_bf16_cp,
              check_kernel_selection, check_offload_exact)
    return run_checks(__doc__, checks,
                      lambda name, rows, use_cuda: f"device: {name}, torch {torch.__version__}, "
                                                   f"backend {'nccl' if use_cuda else 'gloo'}")


if __name__ == "__main__":
    sys.exit(main())
