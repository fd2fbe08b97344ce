"""How many decoder layers FSDP2 holds unsharded in each phase, before and after
`parallel.sharding.shard_model` (issue 43 item 2): tiny qwen3 (4 layers, float64), W ranks
on gloo, generate + score + one exact context-parallel step; the highest count per phase
on each rank (tests/parallel/fsdp_worker.py counts right after every FSDP2 all-gather, at
every layer's forward and every gradient reaching a layer's output). The planner counts
two gathered layers (plan/memory.py).

    python bench/fsdp2_unsharded_layers.py --world 2 --out bench/results/fsdp2_unsharded_layers_w2.txt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.parallel import fsdp_worker  # noqa: E402
from tests.ranks import spawn  # noqa: E402

WRAPS = {"old": "fully_shard(layer) for each layer, no root (before)",
         "shard_model": "parallel.sharding.shard_model (after)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    lines = [f"# python bench/fsdp2_unsharded_layers.py --world {args.world}  (tiny qwen3, 4 layers, P = 23, "
             "chunk 6, exact, context-parallel over every rank; planned: 2 gathered layers)",
             "wrapping\trank\tgenerate\tscore\tcapture\treplay\twalk\tafter step"]
    with tempfile.TemporaryDirectory() as tmp:
        for wrap, what in WRAPS.items():
            out = os.path.join(tmp, wrap)
            spawn(fsdp_worker.run_counts, args=(args.world, os.path.join(tmp, f"init_{wrap}"), wrap, out),
                  nprocs=args.world, join=True)
            for rank in range(args.world):
                seen = json.load(open(f"{out}.rank{rank}.json"))
                lines.append("\t".join([what, str(rank)] + [str(seen[k]) for k in
                                                            ("generate", "score", "capture", "replay", "walk",
                                                             "after step")]))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
