"""The planner's whole peak per rank against a real sharded step (issue 43, "planned =
measured for the sharded options"), at W = 2 and 3 on gloo (CPU, fp32, spawned): tiny qwen3
with FSDP2 over its decoder layers (`--shard-params`, `parallel.sharding.shard_model`) and
tiny glm_moe_dsa with expert parallelism (`--expert-parallel`), both alone and together,
detached and exact. Measured: the rank's live tensors during each of three steps after the
first (Adam state alive from it, gradients None at each start) above what was alive before
the model was built, the worst step; planned: `peak_bytes_per_rank` of `longstraw plan
--model DIR/config.json` (`bench/plan_sharded_peak_live.py`, which writes the rows of
bench/results/plan_sharded_peak_live.csv). As in `test_plan_weights_live.py`: the fullest
rank within 10% of the plan, and no rank above it by more.

Why the worst of three steps: under FSDP2 one step peaks a whole layer buffer (2.77 MB,
a layer's weights 2.75 MB) above or below the next, as gloo's collectives return before or
after the layer's reshard (one rank of qwen3 at W = 3, detached: 48.5, 51.3, 54.0 MB above
the model and Adam state in steps of one process). One step sampled gave planned / measured
1.11 for that row (the least of them); the plan holds the worst (1.04). About 15 s a case
on two cores: all -m slow (the static part alone runs by default:
`test_plan_weights_live.py`)."""

from __future__ import annotations

import pytest

from bench.plan_sharded_peak_live import run

CASES = [("qwen3", "shard_params"), ("glm_moe_dsa", "expert_parallel"), ("glm_moe_dsa", "both")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("world", [2, 3])
def test_planned_step_peak_per_rank_matches_the_live_tensors(tmp_path, world, mode):
    rows = run(str(tmp_path), world, CASES, [mode])
    bad = []
    for r in rows:
        ratios = [round(r["planned"] / m, 3) for m in r["per_rank"]]
        print(f"{r['family']} {r['option']} W={world} {mode}: planned {r['planned']:,} B, per rank (worst step) "
              f"{r['per_rank']}, least step {r['least']:,}, planned / measured {ratios}")
        if abs(r["planned"] / max(r["per_rank"]) - 1) > 0.10 or min(ratios) < 0.90:
            bad.append((r["family"], r["option"], ratios))
    assert not bad, bad
