"""Batched replay of MLA / DSA layers (`ExecConfig.replay_batch`): the branches of a batch
run the layer's attention one after another against the shared prompt state (read
only; DSA's selection is per query anyway), while the rest of each decoder layer (norms,
MLP / MoE) runs the whole batch. GLM-5's shared layers get each branch's own indices."""

from __future__ import annotations

import torch

from .routing import Phase, current_call


def each_branch(forward, module, spec, hidden_states, position_embeddings, prev_indices):
    """Phase REPLAY of B branches (batched replay): hidden_states [B, T, d] -> [B, T, d]
    (and GLM-5's indices [B, T, K], for the next shared layer), each branch's rows run by
    `forward` (`mla.mla_forward`) in turn against the same prompt state (read only); the layers around
    the attention (norms, MLP / MoE) run the batch at once."""
    assert current_call().phase is Phase.REPLAY, "a batch of branches is replay's"
    def row(x, i):  # branch i's rows of a per-branch tensor (or the one shared by all)
        return x[i:i + 1] if isinstance(x, torch.Tensor) and x.shape[0] > 1 else x

    outs = [forward(module, spec, hidden_states[i:i + 1],
                        position_embeddings=None if position_embeddings is None else
                        tuple(row(p, i) for p in position_embeddings),
                        prev_topk_indices=None if prev_indices is None else prev_indices[i])
            for i in range(hidden_states.shape[0])]
    out = torch.cat([o[0] for o in outs])  # (B, T, d)
    if not spec["returns_topk"]:
        return out, None
    indices = [o[2] for o in outs]
    return out, None, (None if indices[0] is None else torch.stack(indices))
