"""The planner's exact-mode walk terms: the recurrent layers' snapshots and their
gradients (`ExecConfig.offload_snapshots`, `state.prompt.RecurrentState`), and the walk's
working set when each decoder layer is recomputed in backward (`recompute_layers`,
`engine/walk.py`). Torch-free; `memory.py` adds them to the peak.

Snapshots. Exact mode keeps, per recurrent layer (GDN, Mamba2, KDA), the state at every
capture-chunk boundary: a recurrent state [H, Dk, Dv] (fp32) + a conv tail
[conv_dim, K - 1] (the model dtype), `pair` bytes over all recurrent layers. With the n
= P - 1 captured positions and capture chunks of C, capture keeps K = |{C, 2C, .. < n}| + 1
of them (the last one at n is the state itself):

    on the device       K - 1 pairs                 (offload_snapshots off)
                        1 pair (the one staged)      (on: the rest in host memory)
    host memory         (K - 1) pairs, pinned       (on)
    D2H                 (K - 1) pairs, at capture   (each snapshot once, when the next arrives)
    H2D                 one pair per walk chunk that starts after 0 and is recomputed
                        (a layer's recompute in backward reuses the staged pair)

Their gradients are never staged: the walk takes each one when it seeds the chunk ending
there (`RecurrentState.take_grad`), so at most two per layer exist (the chunk end's, held
as a seed, and the chunk start's, accumulating): 2 pairs in the accumulation dtype.

Walk recompute. A walk chunk of T tokens keeps every layer's input [T, d] and backpropagates
one layer at a time (`working.recompute_pass`, as replay's pieces), with the chunk's
state-gradient seeds and (DSA) the live layer graphs' top-k selections beside it. The divided walk (each
rank recomputes its own n of the chunk's T positions) keeps its n rows per layer, and one
layer at a time holds its own rows' graph plus what that layer keeps for the whole chunk
(the rows gathered from every rank, the chunk's replicated GDN recurrence:
`memory._gathered_walk_row_bytes`), its self-attention part and its attention transient.
"""

from __future__ import annotations

from ..parallel.deal import walk_chunk_bounds
from .working import attention_working, graph_bytes_per_token, mlp_graph_bytes_per_token, recompute_pass, self_scores


def snapshot_pair_bytes(sizes: dict) -> int:
    """Bytes of one snapshot of every recurrent layer (`state_sizes.state_sizes` figures)."""
    return sizes["recurrent_fixed"] + sizes["conv_tail_fixed"]


def snapshot_grad_bytes(sizes: dict, b: int, acc: int) -> int:
    """Device bytes of the snapshots' gradients at their peak: two positions per layer,
    the conv tail's in the accumulation dtype."""
    return 2 * (sizes["recurrent_fixed"] + sizes["conv_tail_fixed"] * acc // b)


def kept_snapshots(positions: int, chunk: int) -> int:
    """Snapshots (beyond the zero state) capture keeps over `positions` tokens in chunks of
    `chunk`: every chunk boundary, and the end."""
    return len(range(chunk, positions, chunk)) + 1 if positions > 0 else 0


def snapshot_plan(sizes: dict, *, positions: int, chunk: int, offload: bool, walk_starts: int) -> dict:
    """Where exact mode's earlier snapshots live and what moves, bytes (per rank: the
    snapshots are replicated).

    Args:
        sizes: `state_sizes.state_sizes` of the model. positions: n = P - 1. chunk: C.
        offload: `offload_snapshots` resolved (host memory for all but the latest).
        walk_starts: recomputed walk chunks that start after position 0.
    """
    pair = snapshot_pair_bytes(sizes)
    earlier = max(kept_snapshots(positions, chunk) - 1, 0) * pair  # all but the latest (the state)
    if not offload:
        return {"offload": False, "device_bytes": earlier, "host_bytes": 0, "h2d_bytes": 0, "d2h_bytes": 0}
    return {"offload": True, "device_bytes": pair if walk_starts else 0, "host_bytes": earlier,
            "h2d_bytes": walk_starts * pair, "d2h_bytes": earlier}


def walk_starts(positions: int, chunk: int, *, divided: bool, world: int, block: int, at_chunks: bool,
                kept_chunks: int = 0) -> int:
    """Walk chunks that are recomputed and start after 0: each stages one snapshot back."""
    if divided:
        n_chunks = len(walk_chunk_bounds(positions, chunk, world, block, at_chunks))
    else:
        n_chunks = -(-positions // chunk) if positions else 0
    return max(n_chunks - kept_chunks - 1, 0)


def own_state_path_bytes_per_token(arch, layer) -> float:
    """Graph bytes per token on the path from a layer's input to its own state rows (the
    walk's roots): attention K (projection, norm, RoPE) and V; MLA the latent rows; a
    recurrent layer its whole mixer (its state roots need the recurrence)."""
    if layer.mixer == "attention":
        return ((3 if arch.qk_norm else 2) + 1) * arch.kv_heads * arch.head_dim
    if layer.mixer == "mla":
        return 4 * (arch.kv_lora_rank + arch.rope_dim)
    return None


def seed_bytes_per_token(arch, b: int) -> float:
    """The chunk's state-gradient seeds, per token over all layers: the copies of the
    accumulated dk / dv (attention, 2 x Hkv x D) or latent-row gradients (MLA, kv_lora +
    rope) that the walk reads for a chunk's roots (`PromptState.chunk_grads`), alive
    until the chunk's backward ends. Recurrent layers seed a per-chunk state, not rows."""
    per = {"attention": 2 * arch.kv_heads * arch.head_dim, "mla": arch.kv_lora_rank + arch.rope_dim}
    return sum(per.get(layer.mixer, 0) for layer in arch.layers) * b


def selection_bytes_per_token(arch, layer, keys: int) -> float:
    """A sparse MLA layer's DSA selection [T, K] (int64) per token, saved for its sparse
    attention's backward (not in `graph_bytes_per_token`, which the replay and capture
    figures use; counted here for the walk's two live layer graphs)."""
    return min(arch.index_topk, keys) * 8 if layer.mixer == "mla" and layer.sparse else 0.0


def walk_recompute_working(s, tokens: int, keys: int) -> float:
    """One walk chunk of `tokens` over `keys` held positions, each layer recomputed in
    backward: the layers' inputs + the largest layer's backward moment (no logits), plus
    what the last layer's recompute keeps until the chunk's backward ends: its saved
    tensors that no root's gradient reaches (a walk has no loss on the chunk's output, so
    everything past the last layer's own state rows: its queries, attention, MLP), plus
    the chunk's state-gradient seeds (`seed_bytes_per_token`) and, for DSA layers, the
    [T, K] selections of the two layer graphs alive (the running one, the last one's).
    Check (P = 4,096, chunks of 2,048, fp32, the blockwise attention backward CUDA runs;
    planner / live tensors): tiny qwen3 0.97, qwen3_5 1.02, glm_moe_dsa 0.96
    (tests/test_plan_live.py)."""
    a = s.arch
    kept, moment, _ = recompute_pass(a, tokens, keys, s.config.attention_block_size, s.b, s.acc,
                                     s.config.self_attention != "flash", s.config.gdn_kernel,
                                     last_output_reached=False, mlp_backward=True)  # no loss on the prompt's tokens
    last = a.layers[-1]
    path = own_state_path_bytes_per_token(a, last)
    whole = graph_bytes_per_token(a, last, s.b, s.config.gdn_kernel)
    retained = whole - (path * s.b + 3 * a.hidden * s.b) if path is not None else mlp_graph_bytes_per_token(a, last, s.b)
    selections = max(selection_bytes_per_token(a, layer, keys) for layer in a.layers) + selection_bytes_per_token(a, last, keys)
    return kept + moment + tokens * (max(retained, 0.0) + seed_bytes_per_token(a, s.b) + selections)


def divided_walk_recompute_working(s, walk_chunk: int, own: int, gathered_row_bytes, backward_row_bytes) -> float:
    """A divided walk chunk of `walk_chunk` tokens, `own` of them this rank's, each layer
    recomputed in backward: the own rows' layer inputs, then per layer its own rows' graph,
    what it keeps for the whole chunk (`gathered_row_bytes(layer)` per chunk token) and, but
    for the last layer (whose output no root reaches), what its backward holds for the whole
    chunk (`backward_row_bytes(layer)`), its dense self part (when counted) and its
    blockwise attention transient; the largest."""
    a, c = s.arch, s.config
    kept = own * (len(a.layers) + 3 + 1) * a.hidden * s.b
    dense = c.self_attention != "flash"
    moment = 0.0
    for i, layer in enumerate(a.layers):
        g = own * graph_bytes_per_token(a, layer, s.b, c.gdn_kernel) + walk_chunk * gathered_row_bytes(layer)
        if i < len(a.layers) - 1:
            g += walk_chunk * backward_row_bytes(layer)
        g += self_scores(a, layer, walk_chunk, s.acc) if dense else 0.0
        attn = attention_working(a, layer, walk_chunk, s.p_rank, c.attention_block_size, s.acc, backward=True, b=s.b)
        moment = max(moment, g + attn)
    return kept + moment
