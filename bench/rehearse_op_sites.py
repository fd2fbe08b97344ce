"""Where a rehearsal's ops come from: `rehearse_plan` for a preset (optionally cut to its
first N layers) with every op the tracker sees counted by the innermost longstraw frame
that issued it. A rehearsal's wall time is about its op count times the fake dispatch's
cost an op, so this names the loops to batch or register (issue 44). The lines starting
with `#` also give the rehearsal's figures against the planner's (`longstraw plan --rehearse`'s table).

    PYTHONPATH=. python bench/rehearse_op_sites.py --model glm-5.2 --layers 4 --prompt-tokens 65536 \\
        --group 8 --response-tokens 1024 --gpus 32 --lora-rank 8 [--top 25] [--out FILE] [--allow-position-overflow]
        [--chunk-size N] [--branch-chunk-size N] [--recompute-layers] [--expert-parallel] [--shard-params]
        [--skip-device-queries] [--by-phase] [--offload-snapshots] [--mode exact]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import longstraw.rehearsal.tracker as tracker
from longstraw.plan.arch import load_model_config
from longstraw.plan.config import PlanConfig
from longstraw.rehearsal.against_plan import comparison, format_comparison, rehearse_plan


def _site() -> str | None:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/longstraw/" in name and "/longstraw/rehearsal/" not in name:
            return f"{name.split('/longstraw/')[-1]}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return None


def emit(lines: list[str], out: str | None) -> None:
    """Print the lines, and write them to `out` when given."""
    print("\n".join(lines))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="glm-5.2")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    ap.add_argument("--prompt-tokens", type=int, default=65536)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response-tokens", type=int, default=1024)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--mode", default="detached")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    ap.add_argument("--allow-position-overflow", action="store_true", help="P + R may pass the model's positions")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--branch-chunk-size", type=int, default=None)
    ap.add_argument("--recompute-layers", action="store_true")
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--shard-params", action="store_true")
    ap.add_argument("--offload-snapshots", action="store_true")
    ap.add_argument("--skip-device-queries", action="store_true",
                    help="count as the tracker does (`LiveBytes.ops`): prim.device queries left out")
    ap.add_argument("--by-phase", action="store_true", help="count by (innermost open phase, site)")
    args = ap.parse_args()
    _, model, _ = load_model_config(args.model)
    if args.layers:
        model["num_hidden_layers"] = args.layers
    extra = {k: getattr(args, k) for k in ("chunk_size", "branch_chunk_size") if getattr(args, k) is not None}
    extra |= {k: True for k in ("recompute_layers", "expert_parallel", "shard_params", "offload_snapshots") if getattr(args, k)}
    config = PlanConfig(prompt_tokens=args.prompt_tokens, group=args.group, response_tokens=args.response_tokens,
                        gpus=args.gpus, lora_rank=args.lora_rank, mode=args.mode, **extra)
    counts: collections.Counter = collections.Counter()
    dispatch = tracker.LiveBytes.__torch_dispatch__

    skip, by_phase = args.skip_device_queries, args.by_phase

    def counted(self, func, types, args=(), kwargs=None):
        if not (skip and func.namespace == "prim"):
            counts[f"{self.current_phase}:{_site()}" if by_phase else _site()] += 1
        return dispatch(self, func, types, args, kwargs)

    tracker.LiveBytes.__torch_dispatch__ = counted
    t0 = time.perf_counter()
    reh = rehearse_plan(model, config, allow_position_overflow=args.allow_position_overflow)
    wall = time.perf_counter() - t0
    against = format_comparison(comparison(model, config, reh)).splitlines()
    lines = [f"# {' '.join(sys.argv)}", f"# wall {wall:.1f} s, {sum(counts.values())} ops"]
    lines += [f"# {line}" for line in against] + ["ops,site"] + [f"{n},{site}" for site, n in counts.most_common(args.top)]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
