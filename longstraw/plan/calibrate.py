"""The H20 calibration of the planner's compute efficiency (`gpus.DEFAULT_EFFICIENCY`):
the share of the bf16 peak that makes the planned capture of the paper's Qwen3.6-27B run
on 8 x H20 take the paper's 4,656 s. A module of its own: it plans (`estimate`), which
`gpus.py` (read by `config.py`) must not import. Torch-free."""

from __future__ import annotations

from .config import PlanConfig
from .estimate import estimate
from .gpus import PAPER_CAPTURE_S, PAPER_RUN, gpu_spec


def calibrate_h20() -> float:
    """The compute efficiency that makes the planner's capture of the paper's run on 8 x
    H20 take `PAPER_CAPTURE_S` (its blocking communication counted too): effective
    TFLOP/s / 148."""
    spec = gpu_spec("h20")
    r = estimate("qwen3.6-27b", PlanConfig(gpu="h20", **PAPER_RUN))
    comm = r["comm"]["phases"]["capture"]["blocking_s"]
    return r["flops_capture"] / (PAPER_CAPTURE_S - comm) / (spec.bf16_tflops * 1e12)
