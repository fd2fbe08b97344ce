"""The planner's generate phase and image rows against live tensors on CPU (issue 43 items
6e, 6f): one row per case, planned and measured bytes and their ratio, with the plan that
leaves the new term out measured in the same run as the baseline.

    generate  `Engine.generate`'s decode loop beyond the weights and the prompt state
              (`LiveBytes` over the engine's "generate" phase hook; tests/test_plan_generate.py),
              against `plan["generate_working_bytes"]`; baseline: the step's own largest
              working set, what a plan without the phase would have counted for it
    vlm       one detached `Engine.step` of the tiny VLM with a screenshot in the prompt,
              beyond the weights and gradients (tests/test_fit_config_images.py), planned with
              the image and as a text prompt

Usage:
    python bench/bench_plan_phases.py --out bench/results/plan_phases_cpu.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rows():
    from tests.test_fit_config_images import vlm_step
    from tests.test_plan_generate import G, P, R, generate_phase

    for family in ("qwen3", "qwen3_5", "glm_moe_dsa"):
        for vocab in (4096, 512):
            planned, measured = generate_phase(family, vocab)
            yield dict(case="generate", family=family, vocab=vocab, P=P, G=G, R=R, planned=planned,
                       measured=measured, ratio=round(planned / measured, 3), baseline="no generate phase",
                       baseline_planned=0, baseline_ratio=0.0)
    planned, as_text, measured = vlm_step("detached", 384, 1, 256)
    yield dict(case="vlm_step_detached", family="tiny_vlm", vocab=4096, P=384, G=2, R=16, planned=planned,
               measured=measured, ratio=round(planned / measured, 3), baseline="as a text prompt",
               baseline_planned=as_text, baseline_ratio=round(as_text / measured, 3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/plan_phases_cpu.csv")
    args = p.parse_args(argv)
    out = list(rows())
    for r in out:
        r["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    for r in out:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
