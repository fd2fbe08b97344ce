"""LongStraw: GRPO updates on million-token prompts under a fixed memory budget.

Capture the shared prompt's per-layer state once without autograd, then replay the
G response branches one at a time with autograd against it.
"""

from .config import ExecConfig, GRPOConfig
from longstraw.engine.engine import Engine
from .errors import (
                     StaleStateError,
                     StateMismatchError,
                     ConfigError,
                     InvalidGroupError,
                     LongStrawError,
                     ModelStateError,
                     PositionLimitError,
                     UnsupportedModelError,
)
from .group import BatchTotals, Group, StepResult
from .models import supported_model_types
from longstraw.engine.rollout import Rollout, SamplingConfig

__version__ = "0.1.0"

__all__ = [
    "Engine", "ExecConfig", "GRPOConfig", "Group", "StepResult", "BatchTotals", "supported_model_types",
    "LongStrawError", "ConfigError", "InvalidGroupError", "PositionLimitError", "UnsupportedModelError",
    "ModelStateError", "StaleStateError", "StateMismatchError", "Rollout", "SamplingConfig",
]
