"""LongStraw: GRPO updates on million-token prompts under a fixed memory budget.

Capture the shared prompt's per-layer state once without autograd, then replay the
G response branches one at a time with autograd against it.

The public API is imported lazily (PEP 562): `ls.Engine`, `from longstraw import
ExecConfig` and every name in `__all__` load their module on first use, so that
`import longstraw.plan` (the capacity planner) needs no torch. A submodule reached as an
attribute (`ls.errors`, `ls.tiny`) is imported on first use as well.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_HOMES = {
    "ExecConfig": "config", "GRPOConfig": "config",
    "Engine": "engine.engine",
    "Rollout": "engine.rollout", "SamplingConfig": "engine.rollout",
    "BatchTotals": "group", "Group": "group", "StepResult": "group",
    "supported_model_types": "models",
    "LongStrawError": "errors", "ConfigError": "errors", "InvalidGroupError": "errors",
    "PositionLimitError": "errors", "UnsupportedModelError": "errors", "ModelStateError": "errors",
    "StaleStateError": "errors", "StateMismatchError": "errors", "EpisodeError": "errors",
    "DoesNotFitError": "errors", "fit_config": "budget", "PromptInputsError": "errors",
    "UnsupportedInputError": "errors", "rehearse": "rehearsal.run", "Rehearsal": "rehearsal.run",
}
"""Each public name -> the module (under longstraw/) that defines it."""

__all__ = [
    "Engine", "ExecConfig", "GRPOConfig", "Group", "StepResult", "BatchTotals", "supported_model_types",
    "LongStrawError", "ConfigError", "InvalidGroupError", "PositionLimitError", "UnsupportedModelError",
    "ModelStateError", "StaleStateError", "StateMismatchError", "Rollout", "SamplingConfig",
    "EpisodeError", "DoesNotFitError", "fit_config", "PromptInputsError", "UnsupportedInputError",
    "rehearse", "Rehearsal",
]


def __getattr__(name: str):
    """Import a public name's module (or a submodule) on first use, and keep the result."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _HOMES:
        value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
