"""Where the FSDP2 step's measured peak goes, against what `ls.fit_config` planned (issue 43,
item 6: `tests/parallel/test_fit_config_fsdp.py`'s live check): W = 2 ranks on gloo, the
wide tiny qwen3 `shard_model`-ed, the least budget `fit_config` accepts, two measured steps
after a warm one (as the test runs them).

Each step is measured twice: `raw` (`bench.live_peak.live_tensor_peak` as the test used to,
the profiler's events as they come) and `settled` (`settle=True`: the collectives held
until gloo's worker has let their tensors go, so that their frees are seen; see
`bench/live_peak.py`). For each, the live tensors at the peak by role, and the planner's
terms of the same config. A row: mode, rank, step, measure, what, bytes.

    python bench/fsdp2_fit_attribution.py --out bench/results/fsdp2_fit_attribution.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tests.ranks import spawn  # noqa: E402

ROLES = (("FSDP::all_gather_copy_out", "FSDP2 unsharded parameters"),
         ("FSDP::all_gather", "FSDP2 all-gather output (flat)"),
         ("FSDP::post_backward_reduce", "FSDP2 reduce-scatter (flat input; sharded output = the new grads)"),
         ("autograd::engine", "autograd backward (a layer's unsharded gradients, activation gradients)"))
"""(the start of a profiler range in an allocation's chain, its role), the first match wins."""


def role(chain: list[str]) -> str:
    """The role of an allocation from its op / frame chain (`bench.live_attribution`)."""
    for key, name in ROLES:
        if any(link.startswith(key) for link in chain):
            return name
    ops = [n for n in chain if n.startswith("aten::")]
    return "other (forward, loss): " + (ops[0] if ops else "-")


def _plan_terms(plan: dict) -> dict:
    """The planner's figures behind the budget (bytes per rank)."""
    outside = plan["param_bytes"] + plan["grad_bytes"] + plan["optimizer_bytes"]
    return {"planned step (peak less weights, grads, optimizer)": plan["peak_bytes_per_rank"] - outside,
            "planned gathered weights": plan["gathered_param_bytes"],
            "planned peak phase " + plan["peak_phase"]: plan["peak_bytes_per_rank"] - plan["static_bytes_per_rank"],
            "planned param bytes": plan["param_bytes"], "planned grad bytes": plan["grad_bytes"]}


def _rank(rank: int, world: int, init: str, out: str, mode: str) -> None:
    import longstraw as ls
    import longstraw.budget as budget_mod
    from bench.live_attribution import live_at_peak
    from bench.live_peak import live_tensor_peak
    from tests.distributed_worker import _init
    from tests.parallel.test_fit_config_fsdp import _grad_bytes, fitted_engine

    _init(rank, world, init)
    plans, estimate = [], budget_mod.estimate  # the last plan fit_config makes: of the config it returns
    budget_mod.estimate = lambda *a, **k: plans.append(estimate(*a, **k)) or plans[-1]
    try:
        model, budget, _, engine, optimizer, group = fitted_engine(world, mode)
    finally:
        budget_mod.estimate = estimate
    rows = [("budget", budget)] + list(_plan_terms(plans[-1]).items())
    for step in range(2):
        for measure in ("raw", "settled"):
            settle = measure == "settled"
            peak = live_tensor_peak(lambda: engine.step(group, ls.GRPOConfig()), settle=settle)
            grads = _grad_bytes(model)
            optimizer.zero_grad(set_to_none=True)
            rows += [(f"step {step} {measure}: peak", peak), (f"step {step} {measure}: grads", grads),
                     (f"step {step} {measure}: peak less grads", peak - grads)]
            at, parts = live_at_peak(lambda: engine.step(group, ls.GRPOConfig()), settle=settle, label=role, stack=False)
            optimizer.zero_grad(set_to_none=True)
            rows.append((f"step {step} {measure} attributed: peak", at))
            rows += [(f"step {step} {measure} attributed: {name}", nbytes) for nbytes, name in parts]
    with open(f"{out}.{rank}", "w") as f:
        json.dump(rows, f)
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="detached,exact")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    table = [("mode", "rank", "what", "bytes")]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            out = os.path.join(tmp, mode)
            spawn(_rank, args=(2, os.path.join(tmp, f"init_{mode}"), out, mode), nprocs=2, join=True)
            for rank in range(2):
                table += [(mode, rank, what, int(nbytes)) for what, nbytes in json.load(open(f"{out}.{rank}"))]
    writer = csv.writer(sys.stdout)
    writer.writerows(table)
    if args.out:
        with open(args.out, "w", newline="") as f:
            csv.writer(f).writerows(table)


if __name__ == "__main__":
    main()
