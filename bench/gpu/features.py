"""GPU check of the features added after `bench/gpu/checks.py` was written: each one
against its own reference path on the same device, float32. Prints a table and ends with
one JSON line.

    python bench/gpu/features.py          # one GPU (a 1-rank NCCL group for expert parallelism)
    python bench/gpu/features.py --cpu    # the same code on CPU (gloo), the smoke run

Checks (each a row: ok, its figure, the limit, seconds):
1. prefix_tree: a group whose responses share segments (a trie below the prompt), exact
   mode, `share_response_prefixes=True` against the flat path (`False`): worst
   per-parameter gradient relative error (limit 1e-5), and the time of each.
2. agent_episode: `generate(environment=, max_turns=3)` on a GDN hybrid: the rollout's
   log-probs of the sampled tokens against `score` of the same group with its loss masks
   (max abs diff, limit 1e-4), then `step` on it.
3. layer_recompute: exact step of a GDN hybrid with `recompute_layers=True` against
   `False` (gradient relative error, limit 1e-5) and the peak memory of each (CUDA).
4. snapshots_on_host: exact step of a GDN hybrid with its recurrent snapshots in host
   memory (`offload_snapshots=True`) against on the device: the same sums, staging only
   copies (gradient relative error, limit 1e-6); the bytes moved.
5. expert_parallel: a 1-rank group, `expert_parallel=True` (HF's `grouped_mm` experts
   on CUDA in bf16, its GPU default; `batched_mm` in float32 on CPU) against the plain
   eager MoE in the same dtype (gradient relative error; limit 16 u = 0.0625 in bf16, the
   bound of checks.py's bf16_exact; 1e-5 in float32). Two or more ranks: tests/parallel.

Not here: the FSDP2 trainer and TRL's tools (their multi-process runs are
`bench/gpu/trainer.py`'s and `tests/integrations/`'s).
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import longstraw as ls  # noqa: E402
from bench.gpu.checks import _rel, run_checks  # noqa: E402
from tests.reference import grads_of, random_group, tiny_family, tiny_hybrid, tiny_model, tree_group  # noqa: E402


def _step(model, group, **kw):
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    result = ls.Engine(model, ls.ExecConfig(**kw)).step(group)
    return result, grads_of(model), time.perf_counter() - t0


def _peak(device, fn):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    return out, (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)


def check_prefix_tree(device: torch.device) -> dict:
    model = tiny_model("qwen3", dtype=torch.float32).to(device)
    group = tree_group(["ABL", "ABC", "AD", "EL", "ABLa"], prompt_len=40, seed=2)
    kw = dict(chunk_size=16, attention_block_size=8, mode="exact")
    _, want, flat_s = _step(model, group, share_response_prefixes=False, **kw)
    _, got, tree_s = _step(model, group, share_response_prefixes=True, **kw)
    return {"check": "prefix_tree", "rel_err": _rel(got, want), "limit": 1e-5, "time_s": tree_s, "flat_s": flat_s}


def check_agent_episode(device: torch.device) -> dict:
    model = tiny_hybrid("qwen3_5", dtype=torch.float32).to(device)
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=8))
    prompt = random_group(97, 30, [1], seed=5).prompt

    def env(branch, response):
        return None if branch == 0 else torch.arange(3 + branch) % 97  # branch 0 ends, the others see 4+ tokens

    t0 = time.perf_counter()
    rollout = engine.generate(prompt, num_samples=3, max_new_tokens=24, eos_token_id=list(range(0, 97, 4)), environment=env,
                              max_turns=3, generator=torch.Generator(device=device).manual_seed(0))
    group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0, 0.5]),
                     loss_masks=rollout.loss_masks)
    scores = engine.score(group, state=rollout.state)
    diffs = [(s - lp)[m.to(s.device)].abs() for s, lp, m in zip(scores, rollout.logprobs, rollout.loss_masks)]
    diff = max(float(d.max()) if d.numel() else 0.0 for d in diffs)
    engine.step(group, state=rollout.state)
    return {"check": "agent_episode", "rel_err": diff, "limit": 1e-4, "time_s": time.perf_counter() - t0,
            "turns": list(rollout.turns), "masked_tokens": int(sum(int((~m).sum()) for m in rollout.loss_masks))}


def check_layer_recompute(device: torch.device) -> dict:
    model = tiny_hybrid("qwen3_5", dtype=torch.float32).to(device)
    group = random_group(97, 64, [40, 25], seed=6) if device.type == "cuda" else random_group(97, 24, [9, 5], seed=6)
    kw = dict(chunk_size=16, attention_block_size=8, mode="exact")
    (_, want, off_s), off_peak = _peak(device, lambda: _step(model, group, recompute_layers=False, **kw))
    (result, got, on_s), on_peak = _peak(device, lambda: _step(model, group, recompute_layers=True, **kw))
    engaged = bool(result.metrics.get("recompute_layers"))  # else the figure is inf: nothing was recomputed
    return {"check": "layer_recompute", "rel_err": _rel(got, want) if engaged else float("inf"), "limit": 1e-5,
            "time_s": on_s, "off_s": off_s,
            "peak_on_bytes": on_peak, "peak_off_bytes": off_peak}


def check_snapshots_on_host(device: torch.device) -> dict:
    model = tiny_hybrid("qwen3_5", dtype=torch.float32).to(device)
    group = random_group(97, 64 if device.type == "cuda" else 24, [9, 5], seed=7)
    kw = dict(chunk_size=8, attention_block_size=8, mode="exact")
    _, want, _ = _step(model, group, offload_snapshots=False, **kw)
    result, got, seconds = _step(model, group, offload_snapshots=True, **kw)
    moved = result.metrics.get("snapshot_h2d_bytes", 0) > 0  # else the figure is inf: nothing went to host
    return {"check": "snapshots_on_host", "rel_err": _rel(got, want) if moved else float("inf"), "limit": 1e-6,
            "time_s": seconds,
            "h2d_bytes": int(result.metrics.get("snapshot_h2d_bytes", 0)),
            "d2h_bytes": int(result.metrics.get("snapshot_d2h_bytes", 0))}


def check_expert_parallel(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    dtype, impl = (torch.bfloat16, "grouped_mm") if cuda else (torch.float32, "batched_mm")
    model = tiny_family("qwen3_moe", num_hidden_layers=3, dtype=dtype).to(device)  # eager experts
    sharded = copy.deepcopy(model)
    sharded.config._experts_implementation = impl
    group = random_group(97, 23, [5, 1, 7], seed=3)
    kw = dict(chunk_size=6, attention_block_size=4, mode="exact", context_parallel=True)
    _, want, _ = _step(model, group, **kw)
    _, got, seconds = _step(sharded, group, expert_parallel=True, **kw)
    return {"check": "expert_parallel", "rel_err": _rel(got, want), "limit": 16 * 2.0 ** -8 if cuda else 1e-5,
            "time_s": seconds,
            "experts": impl, "dtype": str(dtype).removeprefix("torch.")}


CHECKS = (check_prefix_tree, check_agent_episode, check_layer_recompute, check_snapshots_on_host,
          check_expert_parallel)


def main() -> int:
    def header(name, rows, use_cuda):
        return f"device: {name}, torch {torch.__version__}, float32 (expert parallel: {rows[-1].get('dtype', '?')})"

    return run_checks(__doc__, CHECKS, header, figure="figure")


if __name__ == "__main__":
    sys.exit(main())
