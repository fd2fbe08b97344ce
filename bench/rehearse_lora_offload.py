"""Real step / rehearsal / planner, per phase, for LoRA and for offload (tiny models, CPU).

For each configuration the same `PlanConfig` gives the planner's figures
(`rehearsal.against_plan.planned_as_rehearsed`: the first group, optimizer state off), a
rehearsal of its step (`rehearse_plan`: fake tensors, CPU branches) and the real step on
the tiny model in float32 (`measure_steps` with the same `LiveBytes` tracker, LoRA
through the rehearsal's own `with_lora`). Device bytes and host bytes apart (host: state
offload's arenas and exact mode's offloaded snapshots, `longstraw.host.host_tensor`).
One JSON row per configuration to bench/results/rehearse_lora_offload.jsonl.

    taskset -c 1 env PYTHONPATH=. python bench/rehearse_lora_offload.py
    taskset -c 1 env PYTHONPATH=. python bench/rehearse_lora_offload.py --qwen36   # rehearsal / planner only:
        # Qwen3.6-27B's dimensions cut to 4 layers (3 GDN, 1 attention), bf16, P = 16,384,
        # G = 2, R = 2,048 in pieces of 2,048, chunks of 4,096; full training and LoRA 16
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings

ROWS = "bench/results/rehearse_lora_offload.jsonl"
P, G, R, C = 2048, 4, 256, 256
CONFIGS = [  # (family, PlanConfig fields)
    ("qwen3", dict(mode="detached", lora_rank=16, lora_targets="attention")),
    ("qwen3", dict(mode="exact", lora_rank=16, lora_targets="all-linear")),
    ("qwen3_5", dict(mode="detached", lora_rank=16, lora_targets="all-linear")),
    ("qwen3_5", dict(mode="exact", lora_rank=16, lora_targets="all-linear")),
    ("qwen3", dict(mode="exact", offload_state=True)),
    ("qwen3_5", dict(mode="exact", offload_state=True)),
    ("qwen3_5", dict(mode="exact", offload_snapshots=True)),
    ("qwen3_5", dict(mode="exact", offload_snapshots=True, lora_rank=16, lora_targets="all-linear")),
]


def row(family: str, fields: dict) -> dict:
    import longstraw as ls
    from longstraw.plan.config import PlanConfig
    from longstraw.rehearsal.against_plan import comparison, rehearsal_exec_config, rehearse_plan
    from longstraw.rehearsal.lora import with_lora
    from longstraw.rehearsal.measure import measure_steps
    from longstraw.rehearsal.run import rehearsal_group
    from longstraw.rehearsal.tracker import LiveBytes
    from longstraw.tiny import TINY_CONFIGS, tiny_model

    model = "tiny-qwen3" if family == "qwen3" else dict(TINY_CONFIGS[family])  # the preset, or the config in code
    c = PlanConfig(prompt_tokens=P, group=G, response_tokens=R, chunk_size=C, gpus=1, dtype="fp32", **fields)
    t0 = time.perf_counter()
    entry = comparison(model, c, rehearse_plan(model, c))
    rehearse_s = time.perf_counter() - t0
    real_model = tiny_model(family)
    if c.lora_rank:
        real_model = with_lora(real_model, c.lora_rank, c.lora_targets)
    tracker = LiveBytes("cpu")
    tracker.adopt(list(real_model.parameters()) + list(real_model.buffers()))
    group = rehearsal_group(prompt_tokens=P, group=G, response_tokens=R, vocab_size=real_model.config.vocab_size)
    t0 = time.perf_counter()
    real = measure_steps(ls.Engine(real_model, rehearsal_exec_config(c)), group, ls.GRPOConfig(), tracker=tracker)[0]
    return {"family": family, "fields": fields, "P": P, "G": G, "R": R, "chunk": C, "dtype": "fp32",
            "real": {"peak": real.peak_bytes, "phases": real.phases, "host": real.host_peak_bytes},
            "rehearsal": {"peak": entry["peak_bytes_per_rank"], "phases": entry["phases"],
                          "host": entry["host_bytes"]},
            "planner": {"peak": entry["planner"]["peak_bytes_per_rank"], "phases": entry["planner"]["phases"],
                        "host": entry["planner"]["host_bytes"]},
            "rehearse_s": round(rehearse_s, 2), "real_s": round(time.perf_counter() - t0, 2),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()}


def qwen36_rows() -> None:
    """Rehearsal / planner at Qwen3.6-27B's dimensions (no real step: 27B-wide layers)."""
    from longstraw.plan.arch import load_model_config
    from longstraw.plan.config import PlanConfig
    from longstraw.rehearsal.against_plan import comparison, rehearse_plan

    _, model, _ = load_model_config("qwen3.6-27b")
    model["num_hidden_layers"] = 4
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(ROWS, "a") as out:
        for lora, targets in ((None, "attention"), (16, "all-linear"), (16, "attention")):
            for mode in ("detached", "exact"):
                fields = dict(mode=mode, lora_rank=lora, lora_targets=targets)
                c = PlanConfig(prompt_tokens=16384, group=2, response_tokens=2048, branch_chunk_size=2048,
                               chunk_size=4096, gpus=1, dtype="bf16", **fields)
                e = comparison(model, c, rehearse_plan(model, c))
                out.write(json.dumps({"family": "qwen3.6-27b[:4]", "fields": fields, "P": 16384, "G": 2, "R": 2048,
                                      "chunk": 4096, "dtype": "bf16", "rehearsal": {
                                          "peak": e["peak_bytes_per_rank"], "phases": e["phases"]},
                                      "planner": {"peak": e["planner"]["peak_bytes_per_rank"],
                                                  "phases": e["planner"]["phases"]},
                                      "ratio": e["ratio"], "commit": commit}) + "\n")
                print(json.dumps(fields), {k: round(v, 3) for k, v in e["ratio"].items()}, flush=True)


def main() -> None:
    warnings.simplefilter("ignore")
    if "--qwen36" in sys.argv:
        return qwen36_rows()
    mib = 2 ** 20
    print(f"tiny models, fp32, CPU, P={P} G={G} R={R} chunks of {C}; MiB real / rehearsal / planner "
          "(rehearsal/planner)")
    with open(ROWS, "a") as out:
        for family, fields in CONFIGS:
            r = row(family, fields)
            out.write(json.dumps(r) + "\n")
            cells = []
            for name in list(r["real"]["phases"]) + ["host"]:
                got = [r[k]["phases"].get(name, 0) if name != "host" else r[k]["host"]
                       for k in ("real", "rehearsal", "planner")]
                ratio = f"{got[1] / got[2]:.3f}" if got[2] else "n/a"
                cells.append(f"{name} {got[0] / mib:.2f}/{got[1] / mib:.2f}/{got[2] / mib:.2f} ({ratio})")
            print(f"{family:8} {json.dumps(fields)}\n    " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
