"""Profile a rehearsal: the qwen3.6-27b preset cut to a few layers, one rank, on fake tensors.

Prints the ops the tracker saw per aten op (the count a rehearsal's wall time follows),
the wall time, and (with --cprofile FILE) writes a cProfile of the whole rehearsal.

    PYTHONPATH=. python bench/profile_rehearse.py --layers 4 --prompt-tokens 262144 --group 2 \
        --response-tokens 2048 [--cprofile /tmp/rh.prof]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import time

import torch
import transformers

import longstraw as ls
from longstraw.plan.arch import load_model_config
from longstraw.rehearsal import tracker as tracker_module

PRESET = "qwen3.6-27b"


def hf_config(layers: int):
    """The preset's text config cut to its first `layers` layers (its layer-type pattern kept)."""
    _, cfg, _ = load_model_config(PRESET)
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    fields["num_hidden_layers"] = layers
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:layers]
    return transformers.AutoConfig.for_model("qwen3_5_text", **fields)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=262144)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--response-tokens", type=int, default=2048)
    ap.add_argument("--piece", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--mode", default="detached")
    ap.add_argument("--cprofile", default=None)
    args = ap.parse_args()
    counts: collections.Counter = collections.Counter()
    dispatch = tracker_module.LiveBytes.__torch_dispatch__

    def counting(self, func, types, args_=(), kwargs=None):
        phase = self._open[-1] if self._open else "-"
        counts[(phase, str(func))] += 1
        return dispatch(self, func, types, args_, kwargs)

    tracker_module.LiveBytes.__torch_dispatch__ = counting
    cfg = ls.ExecConfig(chunk_size=args.chunk, mode=args.mode, branch_chunk_size=args.piece,
                       allow_position_overflow=True)  # the paper runs P + R past the 262,144 window
    prof = cProfile.Profile() if args.cprofile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    r = ls.rehearse(hf_config(args.layers), cfg, prompt_tokens=args.prompt_tokens, group=args.group,
                    response_tokens=args.response_tokens, device="cpu", dtype=torch.bfloat16)
    if prof:
        prof.disable()
        prof.dump_stats(args.cprofile)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    total = sum(counts.values())
    print(f"wall {wall:.1f} s, cpu {cpu:.1f} s, ops {r.steps[0].ops} ({1e3 * wall / max(1, r.steps[0].ops):.2f} ms/op), "
          f"peak {r.peak_bytes_per_rank / 2**30:.2f} GiB, phases "
          + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in r.phases.items()))
    phases: collections.Counter = collections.Counter()
    for (phase, name), n in counts.items():
        if not name.startswith("prim."):
            phases[phase] += n
    print("ops per phase (prim metadata queries not counted):", dict(phases))
    for (phase, name), n in counts.most_common(40):
        print(f"{n:8d} {100 * n / total:5.1f}%  {phase:8s} {name}")


if __name__ == "__main__":
    main()
