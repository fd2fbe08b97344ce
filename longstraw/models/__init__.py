"""Model-family adapters and the registry keyed by `config.model_type`."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter, unwrap_causal_lm
from .dense import DenseAdapter
from .hybrid import HybridAdapter
from .mla import MLAAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    t: cls for cls in (DenseAdapter, HybridAdapter, MLAAdapter) for t in cls.model_types
}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for a (possibly PEFT-wrapped) Hugging Face causal LM.

    Raises:
        UnsupportedModelError: for an unknown `config.model_type`, listing the supported ones.
    """
    base = unwrap_causal_lm(model)
    model_type = getattr(base.config, "model_type", None)
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    return ADAPTERS[model_type](model)


__all__ = ["Adapter", "adapter_for", "supported_model_types", "ADAPTERS"]
