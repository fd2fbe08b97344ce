"""Model-family adapters and the registry keyed by `config.model_type`.

    routing.py        the phase of a run (`Phase`), the call its layers read
                      (`AttentionCall`), the one switch over phases, context
                      parallelism's `Divided` / `DividedChunk`
    base.py           the `Adapter` interface the engine calls
    attention.py      full attention (the "longstraw" attention function), every phase
    gated_deltanet.py Gated DeltaNet layers, every phase
    mla.py            MLA (+ DSA) layers, every phase but decode; mla_decode.py: decode
    dense.py, hybrid.py  the adapters of the dense and hybrid families
    mamba2.py         Mamba2 mixers, every phase; mamba_hybrid.py: their adapter (Nemotron-H, Bamba, Granite 4.0)
    falcon_h1.py      Falcon-H1's adapter: attention and Mamba2 side by side in each layer
    kimi_linear.py    Kimi Delta Attention layers, every phase, and Kimi Linear's adapter (KDA + NoPE MLA)
    moe.py            dense attention + MoE blocks (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2)
    windowed.py       per-layer sliding / full attention (OLMo 3, Gemma 3, gpt-oss)
    peft_layers.py, placement.py, rope.py  what the adapters check and pin
"""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from . import attention  # noqa: F401  (registers the "longstraw" attention function with transformers)
from .base import Adapter, unwrap_causal_lm
from .dense import DenseAdapter
from .hybrid import HybridAdapter
from .falcon_h1 import FalconH1Adapter
from .kimi_linear import KimiLinearAdapter
from .mamba_hybrid import MambaHybridAdapter
from .mla import MLAAdapter
from .moe import MoEAdapter
from .windowed import WindowedAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    t: cls for cls in (DenseAdapter, HybridAdapter, MLAAdapter, MoEAdapter, WindowedAdapter,
                                   MambaHybridAdapter, KimiLinearAdapter, FalconH1Adapter) for t in cls.model_types
}


def supported_model_types() -> list[str]:
    """The registered `model_type`s, grouped by adapter (dense, hybrid, MLA, MoE, windowed, Mamba2 hybrid, Kimi Linear, Falcon-H1)."""
    return list(ADAPTERS)


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
