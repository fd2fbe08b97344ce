"""The planner's peak per rank against a real sharded step (issue 43, "planned = measured
for the sharded options"), on gloo (CPU, fp32, spawned ranks), context parallel over W
ranks: tiny qwen3 with FSDP2 over its decoder layers (`--shard-params`,
`parallel.sharding.shard_model`) and tiny glm_moe_dsa with expert parallelism
(`--expert-parallel`); `replicated` (qwen3, neither) is the baseline of the same run.

Measured on each rank: one Adam training step first (so the optimizer state exists, as in
a run), gradients then set to None; then, for each of `STEPS` more steps, the live bytes
of the rank (every torch storage alive, DTensors by their local shard, each once:
`tests/parallel/test_plan_weights_live.live_bytes`) minus those alive before the model was
built, plus the live-tensor peak of the step above that (`bench.live_peak`, `settle=True`:
gloo frees a collective's tensors on its worker thread, unseen by the profiler; before it
the same step read up to a layer buffer more from step to step). The worst of
those steps is the rank's peak (what a budget must hold), the least is reported beside it:
under FSDP2 the same step peaks a whole layer buffer higher or lower from step to step
(tiny qwen3 at W = 3, one rank: 48.5, 51.3 and 54.0 MB above the model, steps of one
process; a layer's weights are 2.75 MB), as gloo's collectives return earlier or later
than the layer's reshard. Planned: `peak_bytes_per_rank` of `longstraw plan --model
DIR/config.json --json` with the same flags (the tiny model's own config). A step of
P = 128, G = 2, R = 256 in one piece, logits chunk 128, no layer recompute.

    PYTHONPATH=$PWD python bench/plan_sharded_peak_live.py [--cases qwen3:shard_params,...]
        [--worlds 2,3] [--modes detached,exact] [--out bench/results/plan_sharded_peak_live.csv]

Rows: family, option, W, mode, planned, measured (the fullest rank's worst step),
least (the least step peak of any rank), ratio (planned / measured).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

P, G, R, LOGITS = 128, 2, 256, 128
STEPS = 3
"""measured steps per rank (after the one that makes the Adam state)"""
OPTIONS = {"replicated": (False, False), "shard_params": (True, False), "expert_parallel": (False, True), "both": (True, True)}
"""option -> (shard_params, expert_parallel)"""


def _measure(rank: int, world: int, init: str, out: str, cases: list, modes: list) -> None:
    """One rank: the step peak of each (family, option, mode), to out.rank as JSON."""
    from tests.distributed_worker import _init

    _init(rank, world, init)
    peaks = {f"{family}:{option}:{mode}": step_peak(world, family, option, mode)
             for family, option in cases for mode in modes}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(peaks, f)
    torch.distributed.destroy_process_group()


def step_peak(world: int, family: str, option: str, mode: str) -> list[int]:
    """Peak live bytes on this rank during each of `STEPS` steps after the first (Adam
    state alive, gradients None at each start), above what was alive before the model was
    built."""
    from torch.distributed.device_mesh import init_device_mesh

    import longstraw as ls
    from bench.live_peak import live_tensor_peak
    from longstraw.models.experts import experts_modules
    from longstraw.parallel.sharding import shard_model
    from longstraw.tiny import tiny_model
    from tests.parallel.test_plan_weights_live import live_bytes
    from tests.reference import uniform_group

    shard, ep = OPTIONS[option]
    before = live_bytes()
    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.float32).train()
    engine = ls.Engine(model, ls.ExecConfig(mode=mode, chunk_size=P, recompute_layers=False,
                                            logits_chunk_size=LOGITS, context_parallel=True, expert_parallel=ep))
    if shard:  # after the engine: expert parallelism cuts the experts first, FSDP2 leaves them alone
        experts = {p for _, m in experts_modules(model) for p in m.parameters(recurse=False)}
        shard_model(model, init_device_mesh("cpu", (world,)), ignored_params=experts)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    group = uniform_group(model.config.vocab_size, P, G, R, seed=0)
    engine.step(group, ls.GRPOConfig())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peaks = []
    for _ in range(STEPS):
        start = live_bytes() - before
        peaks.append(start + live_tensor_peak(lambda: engine.step(group, ls.GRPOConfig()), settle=True))
        optimizer.zero_grad(set_to_none=True)
    return peaks


def planned(tmp: str, family: str, option: str, world: int, mode: str) -> dict:
    """`longstraw plan --model DIR/config.json --json` for the measured step."""
    from longstraw.cli import main
    from longstraw.tiny import tiny_model

    shard, ep = OPTIONS[option]
    path = os.path.join(tmp, family)
    tiny_model(family, dtype=torch.float32).config.save_pretrained(path)
    argv = ["plan", "--model", os.path.join(path, "config.json"), "--prompt-tokens", str(P), "--group", str(G),
            "--response-tokens", str(R), "--gpus", str(world), "--dtype", "float32", "--mode", mode,
            "--chunk-size", str(P), "--logits-chunk-size", str(LOGITS), "--recompute-layers", "off",
            "--first-group", "--json"]
    argv += ["--shard-params"] * shard + ["--expert-parallel"] * ep
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(argv) in (0, None)
    return json.loads(printed.getvalue())


def run(tmp: str, world: int, cases: list, modes: list) -> list[dict]:
    """Rows (family, option, W, mode, planned, measured, least, ratio, per_rank: each rank's
    worst step) of one spawned group."""
    from tests.ranks import spawn

    out = os.path.join(tmp, "peak")
    spawn(_measure, args=(world, os.path.join(tmp, "init"), out, cases, modes), nprocs=world, join=True)
    by_rank = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            by_rank.append(json.load(f))
    rows = []
    for family, option in cases:
        for mode in modes:
            steps = [m[f"{family}:{option}:{mode}"] for m in by_rank]
            measured = [max(s) for s in steps]
            plan = planned(tmp, family, option, world, mode)
            rows.append({"family": family, "option": option, "W": world, "mode": mode,
                         "planned": int(plan["peak_bytes_per_rank"]), "measured": max(measured),
                         "least": min(min(s) for s in steps),
                         "ratio": round(plan["peak_bytes_per_rank"] / max(measured), 3), "per_rank": measured,
                         "steps": steps, "phase": plan["peak_phase"]})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="qwen3:replicated,qwen3:shard_params,glm_moe_dsa:expert_parallel,"
                                       "glm_moe_dsa:both")
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--modes", default="detached,exact")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    rows = []
    for world in [int(w) for w in a.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            rows += run(tmp, world, cases, a.modes.split(","))
    for r in rows:
        print(r)
    if a.out:
        new = not os.path.exists(a.out)
        with open(a.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["family", "option", "W", "mode", "planned", "measured", "least", "ratio"],
                               extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
