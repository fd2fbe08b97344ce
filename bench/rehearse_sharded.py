"""The sharded options rehearsed, planned and run for real, phase by phase (issue 44):
`longstraw plan --rehearse` with `--shard-params` (tiny qwen3, fp32) and
`--shard-params` on a small Qwen3-MoE (bf16; FSDP2 over its experts too), and
`--expert-parallel` alone and with `--shard-params` (the same MoE), at W = 2
and 3 on gloo (spawned, CPU). For each case and rank: the planner's peak per phase (the
step a rehearsal runs: first group, no optimizer state, `against_plan.planned_as_rehearsed`),
the rank's rehearsal (`ls.rehearse(..., world_size=W, rank=r)`) and the same rank's real
step (the same tracker and measured step, collectives settled; `tests/rehearsal/ranks_worker.py`),
in live bytes. A row: case, world, mode, rank, phase, planned, rehearsed, real.

    taskset -c 1 env PYTHONPATH=. python bench/rehearse_sharded.py --out bench/results/rehearse_sharded.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MOE = {"model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
       "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
       "tie_word_embeddings": False}
"""tests/rehearsal/test_against_plan.py's small Qwen3-MoE."""

CASES = {"fsdp2": ("tiny-qwen3", "fp32", dict(shard_params=True)),
         "fsdp2-moe": (MOE, "bf16", dict(shard_params=True)),  # FSDP2 shards the experts with each layer
         "ep": (MOE, "bf16", dict(expert_parallel=True)),
         "ep+fsdp2": (MOE, "bf16", dict(expert_parallel=True, shard_params=True))}


def plan_config(option: str, world: int, mode: str):
    from longstraw.plan.config import PlanConfig

    _, dtype, flags = CASES[option]
    return PlanConfig(prompt_tokens=256, group=2, response_tokens=8, chunk_size=128, dtype=dtype,
                      attention_block_size=32, gpus=world, mode=mode, **flags)


def worker_case(option: str, world: int, mode: str) -> dict:
    """The case `tests/rehearsal/ranks_worker.py` runs: the planned step's ExecConfig."""
    from longstraw.rehearsal.against_plan import hf_config, rehearsal_exec_config

    model, dtype, flags = CASES[option]
    c = plan_config(option, world, mode)
    fields = {f.name: getattr(rehearsal_exec_config(c), f.name) for f in dataclasses.fields(rehearsal_exec_config(c))}
    return {"config": hf_config(model).to_dict(), "dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
            "P": c.prompt_tokens, "G": c.group, "R": c.response_tokens, "mode": mode, "exec": fields,
            "shard": flags.get("shard_params", False), "ep": flags.get("expert_parallel", False)}


def rows_of(option: str, world: int, mode: str, tmp: str) -> list[tuple]:
    from longstraw.rehearsal.against_plan import planned_as_rehearsed
    from tests.ranks import spawn
    from tests.rehearsal import ranks_worker

    model = CASES[option][0]
    planned = planned_as_rehearsed(model, plan_config(option, world, mode))
    case = worker_case(option, world, mode)
    out = os.path.join(tmp, f"{option}_{world}_{mode}")
    spawn(ranks_worker.run, args=(world, out + ".init", out, [case]), nprocs=world, join=True)
    rows = []
    for rank in range(world):
        got = json.load(open(f"{out}.{rank}"))
        real, fake = got["real"][0], got["fake"][0]
        rows.append((option, world, mode, rank, "peak", planned["peak_bytes_per_rank"], fake["peak"], real["peak"]))
        for phase, peak in real["phases"].items():
            rows.append((option, world, mode, rank, phase, planned["phases"].get(phase, ""),
                         fake["phases"].get(phase, ""), peak))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--options", default="fsdp2,fsdp2-moe,ep,ep+fsdp2")
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--modes", default="detached,exact")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    table = [("option", "world", "mode", "rank", "phase", "planned", "rehearsed", "real")]
    with tempfile.TemporaryDirectory() as tmp:
        for option in args.options.split(","):
            for world in map(int, args.worlds.split(",")):
                for mode in args.modes.split(","):
                    table += rows_of(option, world, mode, tmp)
    csv.writer(sys.stdout).writerows(table)
    if args.out:
        with open(args.out, "w", newline="") as f:
            csv.writer(f).writerows(table)


if __name__ == "__main__":
    main()
