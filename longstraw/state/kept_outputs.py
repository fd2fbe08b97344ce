"""Exact mode's kept attention outputs (`ExecConfig.keep_attention_outputs`): what
attention's backward needs from its forward and cannot cheaply rebuild.

The reverse walk recomputes each prompt chunk with autograd. For a flash-style attention
layer its backward needs the chunk's q, k, v (cheap: projections of the layer's input,
which the walk recomputes anyway) and the forward's output o and log-sum-exp L per query
(the expensive part: attention over every earlier prompt position). Capture computes o
and L a moment earlier, so with this option it keeps them, and the walk's attention
forward returns the kept o without attending again (`ops/flash.KeptAttention`); its
backward is the ordinary flash backward from (q, k, v, o, L). The walk then recomputes
only norms, projections and the MLP.

Per attention layer and prompt position: o [H, Dv] in the model's dtype (what the flash
backward reads) and L [H] in the accumulation dtype. Kept on the compute device; each
chunk's entries are dropped once the walk has backpropagated through that chunk.

Legend: H query heads, T tokens of one capture chunk, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KeptOutputs:
    """(layer index, chunk start) -> (o [H, T, Dv], lse [H, T]) of the chunks capture ran.

    Fields:
        rows: the kept pairs.
    """

    rows: dict = field(default_factory=dict)

    def put(self, layer: int, start: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep layer `layer`'s output and LSE for the chunk at positions start .. start + T."""
        assert out.dim() == 3 and lse.shape == out.shape[:2], (out.shape, lse.shape)
        assert not out.requires_grad and not lse.requires_grad, "kept outputs are constants of capture"
        self.rows[(layer, start)] = (out, lse)

    def get(self, layer: int, start: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept pair of this layer and chunk, or None. Read, not taken: a layer
        recomputed inside backward (`recompute_layers`) reads it a second time."""
        kept = self.rows.get((layer, start))
        if kept is not None:
            assert kept[0].shape[1] == tokens, f"layer {layer} at {start}: kept {kept[0].shape[1]} tokens, not {tokens}"
        return kept

    def drop(self, start: int) -> None:
        """Free the chunk at `start` (every layer's): the walk is done with it."""
        for key in [k for k in self.rows if k[1] == start]:
            del self.rows[key]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.rows.values() for t in pair)
