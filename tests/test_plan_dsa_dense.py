"""A DSA layer whose queries see no more than top-k positions is planned as the engine
runs it: dense attention over the latent, no indexer selection (`models/mla._mla_chunk`
goes dense when `index_topk >= start + T`; `plan/working.attention_working`). Before,
the planner planned the indexer's top-k and the [T, K] gather there: tiny glm_moe_dsa, one
process, P = 128, R = 128 in one piece (logits chunk 128, no recompute), replay working
set planned / live tensors 1.328; after 1.136 (P = 128, R = 256, sparse: 1.033 both)."""

from dataclasses import replace

import torch

from longstraw.plan.arch import architecture
from longstraw.plan.working import attention_working
from longstraw.tiny import tiny_model


def _arch():
    return architecture(tiny_model("glm_moe_dsa", dtype=torch.float32).config.to_dict())


def test_a_dsa_layer_within_top_k_positions_is_planned_dense():
    arch = _arch()
    sparse = next(layer for layer in arch.layers if layer.sparse and layer.indexer)
    dense = replace(sparse, sparse=False, indexer=False)
    k = arch.index_topk
    for queries, keys in [(k // 2, k // 2), (k // 4, 0 + 1), (k - 1, 1)]:  # every query sees <= top-k positions
        for backward in (False, True):
            assert (attention_working(arch, sparse, queries, keys, 64, 4, backward=backward)
                    == attention_working(arch, dense, queries, keys, 64, 4, backward=backward))
    # beyond top-k it is the sparse plan, and so is a rank's share under context parallelism
    assert attention_working(arch, sparse, k, k, 64, 4, backward=True) != attention_working(arch, dense, k, k, 64, 4,
                                                                                            backward=True)
    cp = replace(arch, context_ranks=2)
    assert attention_working(cp, sparse, k // 2, k // 2, 64, 4, backward=True) != attention_working(
        cp, dense, k // 2, k // 2, 64, 4, backward=True)
