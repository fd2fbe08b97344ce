"""Mamba2 + attention hybrids: Nemotron-H / Nemotron Nano (`nemotron_h`), Bamba
(`bamba`) and Granite 4.0 (`granitemoehybrid`).

Most layers are Mamba2 mixers; their state is a constant-size `RecurrentState` (SSM
state [H, P, N] in fp32 + conv tail [conv_dim, K-1]), routed through `mamba2.py`. The
few attention layers keep `AttentionKV` and go through the shared attention function
(`attention.py`); MLP / MoE blocks and norms are the model's own. Where a layer's mixer
lives differs by family: Nemotron-H has one `mixer` per block (`block_type` mamba,
attention, mlp or moe; the MLP / MoE blocks keep nothing), Bamba and Granite a
`mamba` or a `self_attn` per decoder layer. Granite's `logits_scaling` divides the
logits outside the decoder stack, so the adapter's `lm_head` applies it
(`ScaledHead`).
"""

from __future__ import annotations

from torch import nn

from longstraw.errors import UnsupportedModelError
from longstraw.state.branch import BranchRecurrent, BranchState
from longstraw.state.prompt import HOST, AttentionKV, PromptState, RecurrentState

from .dense import DenseAdapter
from .mamba2 import routed_mamba2


class ScaledHead(nn.Module):
    """The model's own lm_head, its logits multiplied by `scale` ([.., d] -> [.., V])."""

    def __init__(self, head: nn.Module, scale: float):
        super().__init__()
        self.head, self.scale = head, scale

    @property
    def weight(self):
        return self.head.weight

    def forward(self, hidden):
        return self.head(hidden) * self.scale


def mamba_of(layer) -> nn.Module | None:
    """The layer's Mamba2 mixer, or None."""
    if getattr(layer, "mamba", None) is not None:
        return layer.mamba
    if getattr(layer, "block_type", None) in ("mamba", "linear_attention") and hasattr(layer, "mixer"):
        return layer.mixer
    return None


def attention_of(layer) -> nn.Module | None:
    """The layer's attention module, or None."""
    if getattr(layer, "self_attn", None) is not None:
        return layer.self_attn
    if getattr(layer, "block_type", None) in ("attention", "full_attention") and hasattr(layer, "mixer"):
        return layer.mixer
    return None


class MambaHybridAdapter(DenseAdapter):
    model_types = ("nemotron_h", "bamba", "granitemoehybrid")
    restarts_at_chunks = True  # its Mamba2 layers recompute from the snapshots at capture-chunk starts
    batches_replay = False  # its Mamba2 mixers run one sequence

    def check_config(self) -> None:
        layers = self.backbone.layers
        both = [i for i, layer in enumerate(layers) if mamba_of(layer) is not None and attention_of(layer) is not None]
        if both:
            raise UnsupportedModelError(
                f"layer {both[0]} runs attention and Mamba2 side by side (Falcon-H1's parallel hybrid), which this "
                "adapter does not hold state for")
        self.mamba_modules = [m for m in map(mamba_of, layers) if m is not None]
        scale = getattr(self.config, "logits_scaling", 1.0) or 1.0
        if scale != 1.0:
            self.lm_head = ScaledHead(self.lm_head, 1.0 / scale)

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        layers = []
        for layer in self.backbone.layers:
            attn = attention_of(layer)
            if mamba_of(layer) is not None:
                layers.append(RecurrentState.empty(start=start, keep_all=exact))
            elif attn is None:
                layers.append(None)  # an MLP / MoE block: nothing to keep
            else:
                kv_heads, head_dim = self.attention_geometry(attn)
                layers.append(AttentionKV.empty(
                    kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim, capacity=positions, start=start,
                    window=None, dtype=self.dtype, device=HOST if host else self.device, shard=shard))
        return PromptState(layers=layers, start=start)

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        start = prompt.start + prompt.length
        layers = []
        for layer, held in zip(self.backbone.layers, prompt.layers):
            attn = attention_of(layer)
            if mamba_of(layer) is not None:
                layers.append(BranchRecurrent.from_snapshot(held.snapshots[start], branches, start))
            else:
                layers.append(None if attn is None else self.branch_kv(attn, branches, capacity, start))
        return BranchState(layers=layers, branches=branches, start=start)

    def check_context_parallel(self, total_positions: int) -> None:
        """Every attention layer is full attention: nothing to refuse."""

    def routing(self):
        return routed_mamba2(self.mamba_modules)
