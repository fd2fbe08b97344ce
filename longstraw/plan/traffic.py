"""The planner's communication: bytes the busiest rank receives in a divided capture and
in exact mode's divided reverse walk under context parallelism (the model by which
`parallel.collectives.Traffic` counts). Torch-free.

Legend: W ranks (`world`), blocks of `block` positions dealt round-robin
(`parallel.deal.Deal`); b the state / activation dtype bytes, acc the accumulation
dtype's (fp32 for half types)."""

from __future__ import annotations

from ..parallel.deal import Deal, walk_chunk_bounds
from .arch import DTYPE_BYTES, Arch, architecture, count_parameters, indexer_parameters, load_model_config

def radix_topk_bytes_per_query(W: int, topk: int, score_bytes: int = 4) -> float:
    """Bytes a rank receives per query of `parallel.topk.global_topk` (the ring model of
    `collectives.Traffic`): the candidate count's all-reduce (4), the radix select's
    (8 score_bytes + 32) / 4 rounds of a 16-bin int32 histogram, the chosen [K] (int32
    positions and scores) summed once, and the all-gather of each rank's count (4)."""
    if W == 1:
        return 0.0
    rounds = (8 * score_bytes + 32) // 4
    return 2 * (W - 1) / W * (4 + rounds * 16 * 4 + topk * (4 + score_bytes)) + (W - 1) * 4


def gathered_topk_bytes_per_query(W: int, topk: int, score_bytes: int = 4) -> float:
    """Bytes a rank receives per query when every rank's K candidates are all-gathered."""
    return (W - 1) * topk * (4 + score_bytes)


def candidate_bytes_per_query(W: int, topk: int, score_bytes: int = 4) -> float:
    """Sparse DSA's candidate exchange per query: the cheaper of the two
    (`parallel.topk.shard_topk` takes the same one; the all-gather at W = 2)."""
    return min(radix_topk_bytes_per_query(W, topk, score_bytes), gathered_topk_bytes_per_query(W, topk, score_bytes))


def _arch_and_bytes(model, dtype: str | None) -> tuple[Arch, int, int]:
    """The model's `Arch`, the bytes of `dtype` (default: the config's, else bf16), and of
    its accumulation dtype (fp32 for half types)."""
    _, cfg, _ = load_model_config(model)
    arch = architecture(cfg)
    b = DTYPE_BYTES[dtype or arch.dtype or "bfloat16"]
    return arch, b, max(4, b)

def divided_capture_traffic(model, *, positions: int, world: int, block: int, chunk_size: int,
                            dtype: str | None = None, exact: bool = False) -> float:
    """Bytes the busiest rank receives in a divided capture of `positions` tokens (the
    model `parallel.collectives.Traffic` counts by):

        attention layer   every other rank's K/V rows, broadcast piece by piece
        MLA layer         every other rank's latent rows (latent | rope key, one row per
                          position: the value is a view of it); a layer running its own
                          DSA indexer where some query sees more than top-k positions
                          also every other rank's indexer keys (for the global top-k)
        GDN layer         the relay: one recurrent state per own block after the first;
                          the all-gather of every block's last K-1 pre-conv rows; and the
                          all-reduce (2 (W-1)/W) of the snapshots every rank keeps (the end;
                          exact mode: every chunk start)
    """
    arch, b, rb = _arch_and_bytes(model, dtype)
    if world == 1:
        return 0.0
    deal = Deal(world, block)
    blocks = -(-positions // block)
    per_rank_blocks = -(-blocks // world)
    snapshots = len(range(chunk_size, positions, chunk_size)) + 1 if exact else 1
    worst = 0.0
    for rank in range(world):
        mine = deal.count(positions, rank)
        own_blocks = len(range(rank, blocks, world))
        relayed = own_blocks - (1 if rank == 0 and own_blocks else 0)
        total = 0.0
        for layer in arch.layers:
            if layer.mixer == "attention":
                total += (positions - mine) * arch.kv_heads * 2 * arch.head_dim * b
            elif layer.mixer == "mla":
                total += (positions - mine) * (arch.kv_lora_rank + arch.rope_dim) * b
                if layer.indexer and arch.index_topk < positions:
                    total += (positions - mine) * arch.index_dim * b
            elif layer.mixer == "gdn":
                state = arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * rb
                tail = arch.conv_dim * (arch.gdn_kernel - 1) * b
                total += relayed * state + (world - 1) * per_rank_blocks * tail
                total += 2 * (world - 1) / world * snapshots * (state + tail)
        worst = max(worst, total)
    return worst

def divided_walk_traffic(model, *, positions: int, world: int, block: int, chunk_size: int,
                         dtype: str | None = None, grad_bytes: float | None = None,
                         recompute: bool = False) -> float:
    """Bytes each rank receives in exact mode's divided reverse walk over `positions`
    tokens (the model `parallel.collectives.Traffic` counts by; every rank receives alike). Per
    walk chunk of T tokens, `most` the most any rank owns of it, per layer:

        attention   the chunk's q/k/v rows (all-gather); the self part's partials (o, lse)
                    of every rank's own query rows (all-gather); past the first chunk the
                    shard's partials over earlier chunks, merged (all-reduces of the max
                    lse and of the weighted [H, T, D + 1]) and, in backward, their dq
                    (all-reduce); the self part's dk, dv and the output gradient
                    (all-reduce)
        GDN         the chunk's projected rows (conv input, b, a; all-gather); the output
                    gradient (all-reduce)
        MLA         the absorbed queries and latent rows (all-gather); an own indexer's
                    inputs (all-gather, no grad); where top-k covers the chunk, as attention
                    (its value the latent's first R columns, its k and v gradients summed
                    apart); else (sparse DSA) the global top-k of every rank's candidates per
                    query (`candidate_bytes_per_query`) and each rank's own rows'
                    selection (an own indexer; an all-gather), the
                    shard's sparse partials (merged) and dq
                    (all-reduce); the output gradient (all-reduce)

    (the backward's all-reduces for every layer but the last, whose output reaches no
    root of a walk chunk), plus, once per step, the all-reduce of the replicated parameters' gradients
    (`grad_bytes`, default: every parameter but the DSA indexers', in `dtype`). With
    `recompute` (the walk's layers recomputed in backward, `recompute_layers`) each layer's
    forward runs twice, its collectives with it: the all-gathers, the forward merges'
    all-reduces and DSA's selection (the rehearsal of Qwen3.6-27B's first 4 layers at
    P = 32,768 on 8 ranks received 1.65x the bytes planned without it). Partials and log-sum-exps are in
    the accumulation dtype (fp32 for half types); the gradients summed over ranks in
    `dtype` (the blockwise kernel's, as on GPU; the CPU fused kernel sums the attention's
    dq, dk, dv in its accumulation dtype, the same bytes in fp32 and fp64)."""
    arch, b, acc = _arch_and_bytes(model, dtype)
    if world == 1:
        return 0.0
    gathered, summed = world - 1, 2 * (world - 1) / world  # all-gather and ring all-reduce, per byte
    h, hkv, d = arch.heads, arch.kv_heads, arch.head_dim
    kl, r = arch.kv_lora_rank, arch.rope_dim
    deal, total, forward = Deal(world, block), 0.0, 0.0  # forward: the forward pass's, run again under recompute
    for a, e in walk_chunk_bounds(positions, chunk_size, world, block, bool(arch.count(mixer="gdn"))):
        t = e - a
        most = max(deal.counts(a, e))
        for i, layer in enumerate(arch.layers):
            # the last layer's output reaches no root of a walk chunk (only its state rows are
            # seeded), so its backward exchanges nothing
            back = i < len(arch.layers) - 1
            if layer.mixer == "attention":
                forward += gathered * most * ((h + 2 * hkv) * d * b + h * (d + 1) * acc)
                total += back * summed * t * (2 * hkv * d + h * d) * b  # the self part's dk, dv; the output's
                if a > 0:  # the shard's partials merged (max, then sum: [H, T, D + 2]) and their dq
                    forward += summed * h * t * (d + 2) * acc
                    total += back * summed * h * t * d * b
            elif layer.mixer == "gdn":
                forward += gathered * most * (arch.conv_dim + 2 * arch.gdn_v_heads) * b
                total += back * summed * t * arch.gdn_v_heads * arch.gdn_v_dim * b
            else:
                forward += gathered * most * (h + 1) * (kl + r) * b
                total += back * summed * h * t * kl * b
                if layer.indexer:
                    forward += gathered * most * ((arch.index_heads + 1) * arch.index_dim * b + arch.index_heads * 4)
                if not layer.sparse or arch.index_topk >= e:
                    forward += gathered * most * h * (kl + 1) * acc
                    total += back * summed * t * (2 * kl + r) * b
                    if a > 0:
                        forward += summed * h * t * (kl + 2) * acc
                        total += back * summed * h * t * (kl + r) * b
                else:
                    if layer.indexer:  # the chunk's global top-k; each rank's rows' selection
                        forward += t * candidate_bytes_per_query(world, arch.index_topk) + gathered * most * arch.index_topk * 4
                    forward += summed * h * t * (kl + 2) * acc
                    total += back * summed * h * t * (kl + r) * b
    if grad_bytes is None:
        grad_bytes = (count_parameters(arch).total - indexer_parameters(arch)) * b
    return total + forward * (2 if recompute else 1) + gathered * 16 + summed * grad_bytes
