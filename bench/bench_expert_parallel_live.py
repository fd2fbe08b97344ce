"""Expert parallelism's live tensors against the planner (CPU, gloo, fp32, W = 2).

Tiny glm_moe_dsa (`longstraw.tiny`: 8 experts, 2 per token, H 256), a replay-bound
detached step (P = 512, G = 2, R = 1,024 in one piece, logits in chunks of 256), context
parallel over 2 processes, with and without `ExecConfig(expert_parallel=True)`. Per rank
it measures the live-tensor peak of the step (`bench.live_peak`) and the bytes of the
tensors autograd saved over the step (storages counted once), and prints the planner's
peak (above weights and optimizer) and its replay graph for the same run.

    PYTHONPATH=. python bench/bench_expert_parallel_live.py [--recompute]

What it shows (docs/distributed.md, "Expert parallelism"): the tensors autograd saves do
not shrink with expert parallelism (HF's grouped_mm experts forward, `longstraw.tiny`'s
default, allocates every token's k rows and zeroes the other ranks'), which is what the
planner now counts (k rows, plus the combined output [H]). The live peak is within 10% of
the plan since the planner counts context parallelism's kept merge partials
(`plan.working.context_parallel_bytes_per_token`; before, the plan was 12-16% under the
measured peak, with or without expert parallelism). tests/parallel/test_plan_live.py holds
that ratio. Ends with one JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.multiprocessing as mp

P, G, R, LOGITS = 512, 2, 1024, 256


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saved during fn(), each counted once (they
    are held until the end, so no address is reused by another)."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(s.nbytes() for s in seen.values())


def _rank(rank: int, world: int, init: str, out: str, recompute: bool) -> None:
    import longstraw as ls
    from bench.live_peak import live_tensor_peak
    from longstraw.tiny import tiny_model
    from tests.distributed_worker import _init
    from tests.reference import uniform_group

    _init(rank, world, init)
    rows = {}
    for ep in (False, True):
        for what in ("peak", "saved"):
            torch.manual_seed(0)
            model = tiny_model("glm_moe_dsa", dtype=torch.float32)
            group = uniform_group(model.config.vocab_size, P, G, R, seed=0)
            engine = ls.Engine(model, ls.ExecConfig(chunk_size=P, recompute_layers=recompute, logits_chunk_size=LOGITS,
                                                    context_parallel=True, expert_parallel=ep))
            step = lambda: engine.step(group, ls.GRPOConfig())  # noqa: E731
            rows[f"{what}_{ep}"] = live_tensor_peak(step) if what == "peak" else _saved_bytes(step)
    json.dump(rows, open(f"{out}.{rank}", "w"))
    torch.distributed.destroy_process_group()


def main() -> None:
    from longstraw.plan import PlanConfig, estimate
    from longstraw.tiny import tiny_model

    recompute = "--recompute" in sys.argv
    out = tempfile.mkdtemp() + "/live"
    mp.spawn(_rank, args=(2, out + ".init", out, recompute), nprocs=2, join=True)
    cfg = tiny_model("glm_moe_dsa", dtype=torch.float32).config.to_dict()
    plans = {ep: estimate(cfg, PlanConfig(prompt_tokens=P, group=G, response_tokens=R, dtype="float32", chunk_size=P,
                                          grads_during_capture=False, recompute_layers=recompute,
                                          logits_chunk_size=LOGITS, gpus=2, expert_parallel=ep))
             for ep in (False, True)}
    planned = {ep: p["peak_bytes_per_rank"] - p["param_bytes"] - p["optimizer_bytes"] for ep, p in plans.items()}
    graph_drop = G * (plans[False]["breakdown"]["replay"]["graph_bytes_per_token"]
                      - plans[True]["breakdown"]["replay"]["graph_bytes_per_token"]) * R
    result = {"recompute_layers": recompute, "planned_peak": planned, "planned_saved_drop": graph_drop, "ranks": []}
    print(f"tiny glm_moe_dsa, W = 2 (gloo, fp32), P = {P}, G = {G}, R = {R}, recompute {recompute}")
    print(f"{'rank':>4} {'expert par.':>11} {'live peak MB':>12} {'planned MB':>10} {'ratio':>6} {'saved MB':>9}")
    for rank in range(2):
        m = json.load(open(f"{out}.{rank}"))
        result["ranks"].append(m)
        for ep in (False, True):
            peak = m[f"peak_{ep}"]
            print(f"{rank:>4} {str(ep):>11} {peak / 1e6:12.1f} {planned[ep] / 1e6:10.1f} {planned[ep] / peak:6.3f} "
                  f"{m[f'saved_{ep}'] / 1e6:9.1f}")
        print(f"     saved tensors, expert parallel minus not: measured {(m['saved_True'] - m['saved_False']) / 1e6:.1f}"
              f" MB, planned {-graph_drop / 1e6:.1f} MB (G x R x the graph bytes per token it adds)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
