"""The working set of a divided capture layer (context parallelism: each prompt token
computed on the rank that owns its block; `parallel/divided.py`), no autograd."""

from __future__ import annotations

from ..defaults import DIVIDED_QUERY_ROWS
from .arch import Arch


def divided_capture_working(arch: Arch, mine: int, chunk: int, b: int, acc: int) -> float:
    """No-grad working set of a divided capture layer on a rank holding `mine` positions:
    the hidden shard, its residual and the layer output ([mine, d] each), plus the larger of
    an attention layer's q/k/v/output rows (the fp32 running output and log-sum-exp of its
    queries, and the partial of up to `DIVIDED_QUERY_ROWS` of them merged into it:
    `ops/divided_runs.workspace_bytes`), an
    MLA layer's (its queries before and after absorption, latent rows, running output, and
    DSA's indexer inputs and running top-k), and a GDN layer's projections (conv input, z,
    gates) with the per-token read of the start
    state and zero-start output (accumulation dtype); the MLP runs in pieces of `chunk`
    (counted by the chunked no-grad working set)."""
    hidden = 3 * mine * arch.hidden * b
    layers = [0.0]
    if arch.count(mixer="attention"):
        run = min(mine, DIVIDED_QUERY_ROWS) * arch.heads * (4 * arch.head_dim + 2) * acc
        layers.append(mine * ((2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * b
                              + arch.heads * (arch.head_dim + 1) * acc) + run)
    if arch.count(mixer="mla"):  # q, absorbed q and the latent rows; fp32 running output; DSA's indices
        h, kl, r = arch.heads, arch.kv_lora_rank, arch.rope_dim
        mla = (h * (arch.nope_dim + r) + (arch.q_lora_rank or 0) + h * (kl + r) + 3 * (kl + r)
               + h * arch.v_head_dim) * b + h * (kl + 1) * acc
        if arch.count(indexer=True):  # indexer queries (and their fp32 copy), keys, weights; the
            # running top-k (positions int64, scores fp32) and the sparse attention's sorted places (int64)
            mla += arch.index_heads * arch.index_dim * (b + 4) + arch.index_dim * b + arch.index_heads * 4
            mla += arch.index_topk * (8 + 4 + 8)
        layers.append(mine * mla)
    if arch.count(mixer="gdn"):
        layers.append(mine * (2 * arch.conv_dim * b + arch.gdn_v_heads * arch.gdn_v_dim * 2 * b
                              + arch.gdn_v_heads * (arch.gdn_k_dim + arch.gdn_v_dim) * acc))
    return hidden + max(layers)
