"""Who holds the bytes at a rehearsed phase's peak: a rehearsal (`ls.rehearse`) whose
tracker also records, for every storage it counts, the innermost longstraw / transformers
frame that made it, and keeps the live set grouped by that frame at the phase's peak. The
diagnostic behind a planner term that a rehearsal disagrees with (issue 44); on real CPU
runs `bench/live_attribution.py` does the same from the profiler.

    PYTHONPATH=. python bench/rehearse_attribution.py --model qwen3.6-27b --prompt-tokens 131072 \\
        --group 2 --response-tokens 2048 --gpus 8 --phase capture [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import longstraw.rehearsal.run as run
from longstraw.rehearsal.tracker import LiveBytes

_MINE = ("longstraw/", "transformers/")


def _where() -> str:
    """The innermost project frame above the tracker (file:function:line)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if any(m in name for m in _MINE) and "longstraw/rehearsal/" not in name:
            return f"{name.split('site-packages/')[-1].split('/work/main/')[-1]}:{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "(no project frame)"


class AttributedLiveBytes(LiveBytes):
    """`LiveBytes` that keeps {frame: bytes} of the live set at `phase`'s highest peak."""

    phase_name = "capture"

    def __init__(self, device_type: str = "cuda"):
        super().__init__(device_type)
        self.labels: dict[int, str] = {}
        self.at_peak: dict[str, int] = {}
        self.best = 0

    def adopt(self, tensors) -> None:
        self._adopting = True
        try:
            super().adopt(tensors)
        finally:
            self._adopting = False

    def _count(self, storage, host: bool = False) -> None:
        key = id(storage)
        if key not in self._bytes:
            self.labels[key] = "(adopted: weights, buffers)" if getattr(self, "_adopting", False) else _where()
        super()._count(storage, host)

    def _bump(self, live: int | None = None) -> None:
        super()._bump(live)
        live = self.live if live is None else live
        if self.phase_name in self._open and live > self.best:
            self.best = live
            groups: dict[str, int] = defaultdict(int)
            for key, nbytes in self._bytes.items():
                if key not in self._host:  # device bytes only (host ones are `host_live`)
                    groups[self.labels.get(key, "?")] += nbytes
            if live > self.live:
                groups[f"(declared workspace: {_where()})"] += live - self.live
            self.at_peak = dict(groups)


def main(argv: list[str]) -> None:
    import torch
    import transformers

    import longstraw as ls
    from longstraw.plan.arch import load_model_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--prompt-tokens", type=int, default=131072)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--response-tokens", type=int, default=2048)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--mode", default="detached")
    p.add_argument("--phase", default="capture")
    p.add_argument("--layers", type=int, default=None, help="cut the preset to its first N layers")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--lora-targets", default="all-linear")
    p.add_argument("--offload-snapshots", action="store_true")
    p.add_argument("--recompute-layers", action="store_true")
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--shard-params", action="store_true")
    p.add_argument("--rank", type=int, default=0, help="the rank rehearsed (context parallel)")
    p.add_argument("--expert-parallel", action="store_true")
    p.add_argument("--dtype", default="bfloat16", help="a torch dtype name: bfloat16, float32")
    p.add_argument("--attention-block-size", type=int, default=None)
    p.add_argument("--branch-chunk-size", type=int, default=None)
    args = p.parse_args(argv)
    _, cfg, _ = load_model_config(args.model)
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    if args.layers:
        fields["num_hidden_layers"] = args.layers
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:args.layers]
    text = {"qwen3_5": "qwen3_5_text"}.get(cfg["model_type"], cfg["model_type"])
    hf = transformers.AutoConfig.for_model(text, **fields)
    trackers = []

    def make(device_type):
        trackers.append(AttributedLiveBytes(device_type))
        trackers[-1].phase_name = args.phase
        return trackers[-1]

    run.LiveBytes = make
    extra = dict(offload_snapshots=True) if args.offload_snapshots else {}
    extra |= dict(recompute_layers=True) if args.recompute_layers else {}
    extra |= dict(chunk_size=args.chunk_size) if args.chunk_size else {}
    extra |= dict(expert_parallel=True) if args.expert_parallel else {}
    extra |= dict(attention_block_size=args.attention_block_size) if args.attention_block_size else {}
    extra |= dict(branch_chunk_size=args.branch_chunk_size) if args.branch_chunk_size else {}
    config = ls.ExecConfig(mode=args.mode, context_parallel=args.gpus > 1, allow_position_overflow=True, **extra)
    r = ls.rehearse(hf, config, prompt_tokens=args.prompt_tokens, group=args.group, response_tokens=args.response_tokens,
                    device="cpu", dtype=getattr(torch, args.dtype), world_size=args.gpus, rank=args.rank if args.gpus > 1 else None,
                    shard_params=args.shard_params,
                    lora_rank=args.lora_rank, lora_targets=args.lora_targets)
    t = trackers[0]
    gib = 2 ** 30
    print(f"{args.phase} peak {t.best / gib:.3f} GiB (rehearsal phases: "
          + ", ".join(f"{k} {v / gib:.3f}" for k, v in r.phases.items()) + ")")
    for label, nbytes in sorted(t.at_peak.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{nbytes / gib:9.3f} GiB  {label}")


if __name__ == "__main__":
    main(sys.argv[1:])
