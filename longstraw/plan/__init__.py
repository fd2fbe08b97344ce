"""Capacity planner: how much memory and time one LongStraw GRPO step needs, from a
model config alone (no weights are loaded and no model is built; this module uses no torch).

    report = estimate("qwen3.6-27b", PlanConfig(prompt_tokens=2_088_960, group=8,
                                                response_tokens=8192, gpus=8))
    report["peak_bytes_per_rank"], report["fits"], report["estimated_time_s"]

`model` is a preset name (`presets.json`, next to this file: HF-style configs with the
source of every figure), a path to a Hugging Face `config.json`, or a config dict.

What is counted (docs/planner.md has every formula and assumption):

* **State** (what capture keeps, per layer): K/V per KV head of full-attention layers,
  the MLA latent + shared rope key, the DSA indexer keys (all three per prompt token);
  the Gated DeltaNet recurrent state (fp32) + conv tail and the last W-1 positions of
  sliding-window layers (constant in P).
* **Static** memory per rank: weights, gradients and Adam state of what is trained (the
  whole model, or LoRA adapters), and the state sharded 1/W under context parallelism
  (per-token part; the constant part is replicated). Exact mode adds a gradient buffer the
  size of the state and, for recurrent layers, the recurrent state at each chunk start.
* **Working** sets, of which only the largest is alive at once: capture of one chunk (no
  autograd), replay of one branch (or one piece of it) with autograd, and in exact mode the
  recompute of one chunk with autograd.
* **Time** from FLOPs at a stated effective throughput, divided over W ranks.

These are estimates of an engine that works as DESIGN.md says, not measurements.
"""

from .arch import (
    DTYPE_BYTES,
    PRESETS_PATH,
    SUPPORTED_MODEL_TYPES,
    Arch,
    LayerSpec,
    ParamCount,
    architecture,
    count_parameters,
    human_bytes,
    load_model_config,
    load_presets,
    parse_bytes,
)
from . import hybrid_arch  # noqa: F401  (registers the recurrent hybrids with arch.py)
from .config import PlanConfig
from .estimate import estimate
from .report import format_report
from .traffic import divided_capture_traffic, divided_walk_traffic

__all__ = ["PlanConfig", "estimate", "format_report", "divided_capture_traffic", "divided_walk_traffic",
           "load_presets", "load_model_config", "parse_bytes",
           "human_bytes", "architecture", "count_parameters", "Arch", "LayerSpec", "ParamCount", "DTYPE_BYTES",
           "PRESETS_PATH", "SUPPORTED_MODEL_TYPES"]
