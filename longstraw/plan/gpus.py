"""GPU presets of the planner (`longstraw plan --gpu NAME`, `PlanConfig(gpu=...)`): the
figures in `gpus.json` next to this file (memory, bf16 dense peak, HBM bandwidth, the
intra-node link, the per-GPU inter-node bandwidth and the host link, each with its
source) and the two efficiency factors that turn datasheet peaks into planned time.
Torch-free.

What a preset sets (a `PlanConfig` field left at its default takes the preset's value;
one given explicitly wins):

* `gpu_memory`: the preset's memory;
* `throughput_tflops`: bf16 dense peak x `DEFAULT_EFFICIENCY` (or the entry's own
  'efficiency');
* `host_bandwidth_gbs`, `intra_node_gbs`, `inter_node_gbs`: nominal x `LINK_EFFICIENCY`
  (the intra-node figure is the datasheet's bidirectional aggregate, halved first: the
  planner counts bytes a rank *receives*).

The compute efficiency is calibrated once, on the paper's one figure that is compute
alone: Qwen3.6-27B capture of 2,088,960 prompt tokens on 8 x H20 in about 4,656 s
(REFERENCE.md). The planner's capture FLOPs on the fullest rank for that run divided by
4,656 s is the effective rate; over the H20's 148 TFLOP/s it is `DEFAULT_EFFICIENCY`
(`calibrate.calibrate_h20` recomputes it; a test checks the constant). Applying the same share to
every GPU is an assumption: a GPU with more FLOP/s per byte of HBM (H100, B200) likely
reaches a smaller share on these bandwidth-heavy kernels, so its times are optimistic.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import ConfigError

GPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpus.json")

DEFAULT_EFFICIENCY = 0.1742
"""Effective share of the bf16 dense peak: calibrated on the paper's H20 capture (module
docstring; `calibrate.calibrate_h20`). 0.1742 x 148 = 25.8 TFLOP/s."""

LINK_EFFICIENCY = 0.8
"""Share of a link's nominal one-direction bandwidth that collectives and copies reach
(NCCL bus bandwidth on NVLink / InfiniBand, pinned-memory PCIe copies: 75-85% is usual);
64 GB/s PCIe Gen5 becomes 51 GB/s, about the 50 the planner used before presets."""

PAPER_CAPTURE_S = 4656.0
"""The paper's capture alone: Qwen3.6-27B, 2,088,960 prompt tokens, 8 x H20 (REFERENCE.md)."""

PAPER_RUN = dict(prompt_tokens=2088960, group=8, response_tokens=8192, gpus=8, lora_rank=16,
                 lora_targets="all-linear", weight_dtype="nf4", branch_chunk_size=2048, score_passes=2,
                 gdn_kernel="fla")
"""The paper's Qwen3.6-27B run on 8 x H20, as PlanConfig fields (docs/planner.md, worked example)."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU preset (figures as in `gpus.json`; GB/s = 1e9 B/s).

    Fields:
        name / description: the preset's key and what it is.
        memory: memory per GPU as the vendor states it ("96GiB", "141GB").
        bf16_tflops: bf16 dense peak (no sparsity).
        hbm_gbs: HBM bandwidth.
        intra_node_gbs: the intra-node link per GPU (NVLink / Infinity Fabric, bidirectional aggregate).
        inter_node_gbs: per-GPU inter-node bandwidth, one direction (a typical deployment).
        host_gbs: host link, one direction (PCIe).
        efficiency: effective share of bf16_tflops (DEFAULT_EFFICIENCY unless the entry states one).
        source: where each figure comes from.
    """

    name: str
    description: str
    memory: str
    bf16_tflops: float
    hbm_gbs: float
    intra_node_gbs: float
    inter_node_gbs: float
    host_gbs: float
    efficiency: float
    source: dict

    @property
    def effective_tflops(self) -> float:
        return self.bf16_tflops * self.efficiency

    def plan_fields(self) -> dict:
        """The PlanConfig fields this preset sets (effective figures)."""
        return {"gpu_memory": self.memory, "throughput_tflops": self.effective_tflops,
                "host_bandwidth_gbs": self.host_gbs * LINK_EFFICIENCY,
                "intra_node_gbs": self.intra_node_gbs / 2 * LINK_EFFICIENCY,
                "inter_node_gbs": self.inter_node_gbs * LINK_EFFICIENCY}


def load_gpus() -> dict[str, GpuSpec]:
    """Every preset of `gpus.json`, by name."""
    with open(GPUS_PATH) as f:
        raw = json.load(f)
    return {name: GpuSpec(name=name, description=e["description"], memory=e["memory"],
                          bf16_tflops=float(e["bf16_tflops"]), hbm_gbs=float(e["hbm_gbs"]),
                          intra_node_gbs=float(e["intra_node_gbs"]), inter_node_gbs=float(e["inter_node_gbs"]),
                          host_gbs=float(e["host_gbs"]), efficiency=float(e.get("efficiency", DEFAULT_EFFICIENCY)),
                          source=e["_source"])
            for name, e in raw.items() if not name.startswith("_")}


def gpu_spec(name: str) -> GpuSpec:
    """The preset `name` (case-insensitive), or a ConfigError listing the presets."""
    gpus = load_gpus()
    key = str(name).lower()
    if key not in gpus:
        raise ConfigError(f"unknown GPU preset {name!r}; presets: {', '.join(gpus)} (plan/gpus.json)")
    return gpus[key]
