"""The fake ops one walk chunk costs, per layer and rank: exact mode's reverse walk
rehearsed at two prompt lengths on the preset cut to a few layers, and the difference
divided by the chunks added, the layers and the ranks rehearsed. The walk is what sets an
exact rehearsal's wall time at the paper's P (255 chunks x 64 layers at chunks of 8,192),
so this names what each walk chunk spends, by the innermost longstraw frame that issued
the op and by aten op (prim metadata queries and profiler records are not counted, as
`LiveBytes.ops` does not count them).

    PYTHONPATH=. python bench/rehearse_walk_ops.py [--layers 4] [--prompt-tokens 131072 262144] \\
        [--top 25] [--out FILE]

The flags are the paper's exact `--fit` choice with bf16 base weights (LoRA 16 all-linear,
chunks of 8,192, layer recompute, snapshots on host, FSDP2) on 8 ranks, G = 2, R = 2,048
(the walk does not depend on G or R).
"""

from __future__ import annotations

import argparse
import collections
import sys

import longstraw.rehearsal.tracker as tracker
from longstraw.plan.arch import load_model_config
from longstraw.plan.config import PlanConfig
from longstraw.rehearsal.against_plan import rehearse_plan
from rehearse_op_sites import _site, emit

CHUNK = 8192


def walk_ops(model: dict, prompt_tokens: int) -> tuple[collections.Counter, int]:
    """{(site, op): count} of the walk's ops at `prompt_tokens`, and the ranks rehearsed."""
    counts: collections.Counter = collections.Counter()
    dispatch = tracker.LiveBytes.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        if func.namespace not in ("prim", "profiler") and self.current_phase == "walk":
            counts[(_site(), str(func))] += 1
        return dispatch(self, func, types, args, kwargs)

    config = PlanConfig(prompt_tokens=prompt_tokens, group=2, response_tokens=2048, gpus=8, lora_rank=16,
                        mode="exact", chunk_size=CHUNK, branch_chunk_size=2048, recompute_layers=True,
                        offload_snapshots=True, shard_params=True)
    tracker.LiveBytes.__torch_dispatch__ = counted
    try:
        reh = rehearse_plan(model, config, allow_position_overflow=True)
    finally:
        tracker.LiveBytes.__torch_dispatch__ = dispatch
    return counts, len(reh.rank_peaks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[131072, 262144])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _, model, _ = load_model_config("qwen3.6-27b")
    model["num_hidden_layers"] = args.layers
    (short, ranks), (long, _) = (walk_ops(model, p) for p in args.prompt_tokens)
    per = (args.prompt_tokens[1] - args.prompt_tokens[0]) // CHUNK * args.layers * ranks
    added = collections.Counter({k: long[k] - short.get(k, 0) for k in long})
    by_site: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for (site, op), n in added.items():
        by_site[site] += n
        by_op[op] += n
    lines = [f"# {' '.join(sys.argv)}",
             f"# walk ops per layer and walk chunk, a rank: {sum(added.values()) / per:.1f}", "ops,site"]
    lines += [f"{n / per:.1f},{site}" for site, n in by_site.most_common(args.top)]
    lines += ["ops,aten op"] + [f"{n / per:.1f},{op}" for op, n in by_op.most_common(args.top)]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
