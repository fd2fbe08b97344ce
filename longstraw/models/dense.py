"""Dense-attention families (`llama`, `mistral`, `qwen2`, `qwen3`, `phi3`).

Each decoder layer is the model's own; its attention module is routed through
LongStraw's LSE-merged prefix attention (`attention.py`). The state is one
`AttentionKV` per layer: K/V per kv head (never GQA-expanded). Sliding-window layers
keep only their last W - 1 positions and mask by position, exactly as HF does.
"""

from __future__ import annotations


from longstraw.state.branch import BranchKV, BranchState
from ..errors import UnsupportedModelError
from longstraw.state.prompt import HOST, AttentionKV, PromptState
from .base import Adapter


def layer_window(config, attn_module) -> int | None:
    """The sliding window a layer's attention module passes to its attention function."""
    if hasattr(attn_module, "sliding_window"):  # qwen2 / qwen3: per layer type
        return attn_module.sliding_window
    return getattr(config, "sliding_window", None)  # mistral: every layer


class DenseAdapter(Adapter):
    model_types = ("llama", "mistral", "qwen2", "qwen3", "phi3")
    batches_replay = True
    divides_capture = True
    divides_walk = True

    def check_config(self) -> None:
        for layer in self.backbone.layers:
            if not hasattr(layer, "self_attn"):
                raise UnsupportedModelError(f"{type(layer).__name__} has no self_attn; not a dense-attention layer")

    def attention_geometry(self, attn) -> tuple[int, int]:
        """(kv_heads, head_dim) of an attention module."""
        head_dim = attn.head_dim
        kv_heads = self.config.num_key_value_heads
        return kv_heads, head_dim

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        layers = []
        for layer in self.backbone.layers:
            attn = layer.self_attn
            kv_heads, head_dim = self.attention_geometry(attn)
            window = layer_window(self.config, attn)
            trimmed = not exact and window is not None  # constant size: stays on the device
            layers.append(AttentionKV.empty(
                kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim, capacity=positions, start=start,
                window=window, dtype=self.dtype, device=HOST if host and not trimmed else self.device,
                trim=not exact, shard=shard,
            ))
        return PromptState(layers=layers, start=start)

    def branch_kv(self, attn, branches: int, capacity: int, start: int) -> BranchKV:
        """Own K/V of the rollout branches for one attention module."""
        kv_heads, head_dim = self.attention_geometry(attn)
        return BranchKV.empty(branches=branches, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
                              capacity=capacity, start=start, window=layer_window(self.config, attn),
                              dtype=self.dtype, device=self.device)

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        start = prompt.start + prompt.length
        layers = [self.branch_kv(layer.self_attn, branches, capacity, start) for layer in self.backbone.layers]
        return BranchState(layers=layers, branches=branches, start=start)
