"""Hybrid recurrent + full-attention families: Qwen3.5 / Qwen3.6 (`qwen3_5`), its MoE
(`qwen3_5_moe`) and Qwen3-Next (`qwen3_next`).

Three of every four layers are Gated DeltaNet (GDN); their state is a constant-size
`RecurrentState` (recurrent state [Hv, Dk, Dv] in fp32 + conv tail [conv_dim, K-1]),
routed through `gated_deltanet.py`. The full-attention layers (output gate, q/k norms,
partial RoPE, all inside HF's module) keep `AttentionKV` and are routed through the
same attention function as the dense families (`attention.py`). MLP / MoE blocks and norms are the model's
own modules, untouched.
"""

from __future__ import annotations


from longstraw.state.branch import BranchRecurrent, BranchState
from ..errors import UnsupportedModelError
from longstraw.state.prompt import HOST, AttentionKV, PromptState, RecurrentState
from .dense import DenseAdapter
from .gated_deltanet import routed_gdn


class HybridAdapter(DenseAdapter):
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
    restarts_at_chunks = True  # its GDN layers recompute from the snapshots at capture-chunk starts

    def check_config(self) -> None:
        layers = self.backbone.layers
        if not all(hasattr(layer, "linear_attn") or hasattr(layer, "self_attn") for layer in layers):
            raise UnsupportedModelError("every hybrid layer needs a linear_attn (GDN) or a self_attn module")
        self.gdn_modules = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        layers = []
        for layer in self.backbone.layers:
            if hasattr(layer, "linear_attn"):
                layers.append(RecurrentState.empty(start=start, keep_all=exact))
                continue
            kv_heads, head_dim = self.attention_geometry(layer.self_attn)
            layers.append(AttentionKV.empty(
                kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim, capacity=positions, start=start,
                window=None, dtype=self.dtype, device=HOST if host else self.device, shard=shard,
            ))
        return PromptState(layers=layers, start=start)

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        start = prompt.start + prompt.length
        layers = []
        for layer, held in zip(self.backbone.layers, prompt.layers):
            if hasattr(layer, "linear_attn"):
                layers.append(BranchRecurrent.from_snapshot(held.snapshots[start], branches, start))
            else:
                layers.append(self.branch_kv(layer.self_attn, branches, capacity, start))
        return BranchState(layers=layers, branches=branches, start=start)

    def routing(self):
        return routed_gdn(self.gdn_modules)
