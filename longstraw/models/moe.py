"""Dense-attention families with MoE blocks: Qwen3-MoE (`qwen3_moe`), Mixtral
(`mixtral`), GLM-4.5 / 4.6 / 4.7 (`glm4_moe`) and MiniMax-M2 (`minimax_m2`).

Their attention is full GQA attention computed by the model's own module (GLM-4.5's
partial RoPE and optional q/k norms, MiniMax-M2's q/k norms over the whole projection
and partial RoPE all happen there) and routed through LongStraw's attention function,
so each layer keeps one `AttentionKV`, exactly as the dense families do.

The MoE blocks are the model's own modules, called untouched in every phase: the
routers (softmax top-k with or without renormalisation for Qwen3-MoE, Mixtral and
MiniMax-M2's sigmoid top-k; GLM-4.5's sigmoid scores with a correction bias, grouped
top-k, a routed scaling factor and shared experts) are therefore HF's own code, PEFT
wrappers on the experts' projections keep working, and they keep no state. What
capture / replay change is only which tokens reach a block together, and a router
decides per token, so the routing equals HF's one pass (float64 tests:
tests/models/test_families.py).
"""

from __future__ import annotations

from .dense import DenseAdapter


class MoEAdapter(DenseAdapter):
    """`DenseAdapter`'s state and phases; the MoE blocks run as the model's own modules."""

    model_types = ("qwen3_moe", "mixtral", "glm4_moe", "minimax_m2")
