"""Falcon-H1 (`falcon_h1`): attention and a Mamba2 mixer side by side in every decoder
layer (a parallel hybrid), both reading the same normed input, their outputs summed.

Each layer keeps both kinds of state: the attention's `AttentionKV` (K/V per position)
and the mixer's constant-size `RecurrentState` (SSM state [H, P, N] + conv tail
[conv_dim, K-1]). The routed code looks a layer's state up by its module's `layer_idx`,
so the prompt state holds 2L entries: layer i's K/V at i, its Mamba2 state at L + i;
inside `routing()` each mixer's `layer_idx` reads L + i (restored after; we never hand
HF a cache, the only other reader). The attention goes through the shared attention
function (`attention.py`), the mixer through `mamba2.py`; both are the model's own
modules, and so are all of Falcon-H1's muP multipliers but one:

    embedding_multiplier        the backbone's forward (embed_tokens(ids) * m)
    key_multiplier              the attention module's forward
    attention_in / _out, ssm_out_multiplier   the decoder layer's forward
    mlp_multipliers             the MLP's forward
    ssm_in_multiplier, mup_vector (ssm_multipliers per in_proj column)   `mamba2._project`,
                                read from the mixer module
    lm_head_multiplier          outside the backbone: the adapter's lm_head (`ScaledHead`)

Context parallelism composes the two divided paths per layer (the attention's sharded
K/V, the mixer's segment transitions), as for the other Mamba2 hybrids.
"""

from __future__ import annotations

import contextlib

from longstraw.errors import UnsupportedModelError
from longstraw.state.branch import BranchRecurrent, BranchState
from longstraw.state.prompt import HOST, AttentionKV, PromptState, RecurrentState

from .dense import DenseAdapter
from .mamba2 import routed_mamba2
from .mamba_hybrid import ScaledHead


class FalconH1Adapter(DenseAdapter):
    model_types = ("falcon_h1",)
    restarts_at_chunks = True  # its Mamba2 mixers recompute from the snapshots at capture-chunk starts
    batches_replay = False  # its Mamba2 mixers run one sequence

    def check_config(self) -> None:
        layers = self.backbone.layers
        for i, layer in enumerate(layers):
            if getattr(layer, "mamba", None) is None or getattr(layer, "self_attn", None) is None:
                raise UnsupportedModelError(f"layer {i} lacks the mamba + self_attn pair of a Falcon-H1 layer")
        self.mamba_modules = [layer.mamba for layer in layers]
        scale = getattr(self.backbone, "lm_head_multiplier", 1.0)
        if scale != 1.0:
            self.lm_head = ScaledHead(self.lm_head, scale)

    def mamba_slot(self, i: int) -> int:
        """Where layer i's Mamba2 state sits in a prompt / branch state (after the L K/V)."""
        return len(self.backbone.layers) + i

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        kv = []
        for layer in self.backbone.layers:
            kv_heads, head_dim = self.attention_geometry(layer.self_attn)
            kv.append(AttentionKV.empty(
                kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim, capacity=positions, start=start,
                window=None, dtype=self.dtype, device=HOST if host else self.device, shard=shard))
        recurrent = [RecurrentState.empty(start=start, keep_all=exact) for _ in self.backbone.layers]
        return PromptState(layers=kv + recurrent, start=start)

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        start = prompt.start + prompt.length
        layers = self.backbone.layers
        kv = [self.branch_kv(layer.self_attn, branches, capacity, start) for layer in layers]
        recurrent = [BranchRecurrent.from_snapshot(prompt.layers[self.mamba_slot(i)].snapshots[start], branches, start)
                     for i in range(len(layers))]
        return BranchState(layers=kv + recurrent, branches=branches, start=start)

    def check_context_parallel(self, total_positions: int) -> None:
        """Every attention layer is full attention: nothing to refuse."""

    @contextlib.contextmanager
    def routing(self):
        saved = [m.layer_idx for m in self.mamba_modules]
        for i, m in enumerate(self.mamba_modules):
            m.layer_idx = self.mamba_slot(i)
        try:
            with routed_mamba2(self.mamba_modules):
                yield
        finally:
            for m, idx in zip(self.mamba_modules, saved):
                m.layer_idx = idx
