"""The planner's time: forward FLOPs of each pass on one rank (projections, MLP/MoE,
attention QK^T / PV, GDN recurrence), the divided capture and reverse walk's shares, and
`Timing`, the step's seconds at a stated effective throughput. Torch-free.

Legend: n_q queries after `prefix` earlier positions; W ranks (`world`); blocks of
`block` positions dealt round-robin (`parallel.deal.Deal`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.deal import Deal
from .arch import BACKWARD_FACTOR, Arch, LayerSpec, ParamCount
from .config import Basis
from .kept_outputs import kept_output_layers

def causal_pairs(n_q: int, prefix: int, limit: int | None) -> float:
    """Query-key pairs of n_q causal queries that follow `prefix` keys, each seeing at
    most `limit` keys (None: all)."""
    total = n_q * prefix + n_q * (n_q + 1) / 2
    if limit is None:
        return total
    # query i (0-based, at absolute position prefix + i) sees min(prefix + i + 1, limit) keys
    first_capped = max(0, limit - prefix - 1)  # queries before this one see < limit keys
    uncapped = min(n_q, first_capped)
    return uncapped * prefix + uncapped * (uncapped + 1) / 2 + (n_q - uncapped) * limit

def mixer_flops(arch: Arch, layer: LayerSpec, n_q: int, prefix: int) -> float:
    """Forward FLOPs of the token mixer beyond its projections: QK^T and PV (2 flops per
    multiply-add) for n_q queries after `prefix` positions. Causal prompt, dense layer:
    2 * (d_qk + d_v) * heads * P^2 / 2 = 4 * P^2 / 2 * heads * head_dim."""
    if layer.mixer == "attention":
        return 2 * arch.heads * 2 * arch.head_dim * causal_pairs(n_q, prefix, layer.window)
    if layer.mixer == "gdn":  # state update + readout, ~4 * v_heads * dk * dv per token
        return 4 * arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * n_q
    kl, r = arch.kv_lora_rank, arch.rope_dim
    f = 2 * arch.heads * (2 * kl + r) * causal_pairs(n_q, prefix, arch.index_topk if layer.sparse else None)
    if layer.indexer:
        f += 2 * arch.index_heads * arch.index_dim * causal_pairs(n_q, prefix, None)
    return f

def kept_attention_flops(arch: Arch, layer: LayerSpec, P: int) -> float:
    """The forward FLOPs over the prompt that a kept attention output saves the walk: QK^T and
    PV of the layer (MLA: over the latent, the indexer not run where every key is selected)."""
    if layer.mixer == "attention":
        return mixer_flops(arch, layer, P, 0)
    return 2 * arch.heads * (2 * arch.kv_lora_rank + arch.rope_dim) * causal_pairs(P, 0, None)

def forward_flops(arch: Arch, params: ParamCount, n_q: int, prefix: int, lm_head: bool, world: int = 1) -> float:
    """Forward FLOPs one rank runs: the token computation (projections, MLP/MoE, GDN,
    lm_head) is replicated on every rank under context parallelism; only attention
    over the (sharded) prompt state is divided by `world`."""
    f = 2 * params.matmul_active * n_q + (2 * arch.vocab * arch.hidden * n_q if lm_head else 0)
    return f + sum(mixer_flops(arch, layer, n_q, prefix) / (1 if layer.mixer == "gdn" else world)
                   for layer in arch.layers)

def divided_flops(arch: Arch, params: ParamCount, positions: int, world: int, block: int) -> float:
    """Forward FLOPs of a divided capture on the fullest rank: the token computation of its
    own positions (each prompt token on one rank), attention of its queries over every
    earlier position (the round-robin deal balances it: ~1/W of the causal pairs), and for
    GDN layers the affine transition ((Dk + Dv) / Dv of one pass of the recurrence) plus
    the read of each start state (2 Dk Dv per head and token)."""
    mine = Deal(world, block).fullest(positions)
    f = 2 * params.matmul_active * mine
    for layer in arch.layers:
        if layer.mixer == "gdn":
            f += mixer_flops(arch, layer, mine, 0) * (arch.gdn_k_dim + arch.gdn_v_dim) / arch.gdn_v_dim
            f += 2 * arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * mine
        else:
            f += mixer_flops(arch, layer, positions, 0) / world
    return f

def own_self_pairs(chunk: int, world: int, block: int) -> float:
    """Causal (query, key) pairs of one walk chunk's self part on the fullest rank, when
    each rank attends for its own query rows only (blocks dealt round-robin from the
    chunk's start): a block at chunk offset a sees a * B + B (B + 1) / 2 pairs."""
    deal = Deal(world, block)
    return max(sum(a * (b - a) + (b - a) * (b - a + 1) / 2 for a, b, _ in deal.blocks(r, chunk))
               for r in range(world))

def divided_walk_flops(arch: Arch, params: ParamCount, positions: int, world: int, block: int,
                       chunk: int) -> float:
    """Forward FLOPs of a divided reverse walk's recompute on the fullest rank: the token
    computation of its own positions, ~1/W of the attention pairs over earlier chunks, each
    chunk's own causal part for its own query rows (`own_self_pairs`; DSA layers: every
    rank runs the chunk's sparse self part and top-k in full), and every GDN layer's
    recurrence over every position (it runs over each whole walk chunk on every rank)."""
    chunks = -(-positions // chunk)
    f = 2 * params.matmul_active * Deal(world, block).fullest(positions)
    for layer in arch.layers:
        whole, self_part = mixer_flops(arch, layer, positions, 0), mixer_flops(arch, layer, chunk, 0)
        if layer.mixer == "gdn":
            f += whole
        elif layer.sparse:
            f += whole / world + chunks * self_part * (1 - 1 / world)
        else:  # the self part's share of the rank's own query rows
            own = self_part * own_self_pairs(chunk, world, block) / causal_pairs(chunk, 0, None)
            f += (whole - chunks * self_part) / world + chunks * own
    return f


@dataclass(frozen=True)
class Timing:
    """FLOPs of one rank and the step's seconds (communication not counted).

    Fields:
        throughput: effective FLOP/s per rank.
        flops_capture: capture of the whole prompt (divided, or replicated but its attention).
        flops_branch: one branch's replay (forward + backward, score passes, held pieces).
        flops_exact_extra: exact mode's reverse walk (recompute + backward).
        t_detached / t_exact: seconds without / with the reverse walk.
        t_transfer: seconds of the offload traffic at the host bandwidth (0 without offload).
    """

    throughput: float
    flops_capture: float
    flops_branch: float
    flops_exact_extra: float
    t_detached: float
    t_exact: float
    t_transfer: float


def plan_time(s: Basis, *, divided: bool, divided_walk: bool, walk_chunk: int, held: int, chunks: int,
              kept_chunks: int, offload: dict | None, recompute: bool = False,
              walk_recompute: bool = False, kept_outputs: bool = False) -> Timing:
    """The step's FLOPs and seconds on one rank. divided / divided_walk: capture / the
    exact walk is divided over the ranks (walk chunks of `walk_chunk` tokens); held:
    branch tokens held as a state while pieces are walked back; chunks / kept_chunks:
    capture chunks, and those whose graphs are kept (not recomputed); recompute: replay
    recomputes each decoder layer in backward (one more forward of the branch's layers,
    not of its lm_head); walk_recompute: so does the exact walk (one more forward of each
    recomputed chunk); kept_outputs: the walk's recomputed forwards skip the attention
    layers' QK^T / PV (`keep_attention_outputs`; its backward is unchanged)."""
    c, arch, params, P, R, G, W = s.config, s.arch, s.params, s.P, s.R, s.G, s.W
    thr = c.throughput_tflops * 1e12
    flops_prompt = forward_flops(arch, params, P, 0, lm_head=False, world=W)  # one replicated prompt forward
    flops_capture = divided_flops(arch, params, P, W, s.block) if divided else flops_prompt
    branch_fwd = forward_flops(arch, params, R, P, lm_head=True, world=W)
    held_fwd = forward_flops(arch, params, held, P, lm_head=False, world=W) if held else 0.0
    flops_branch = (1 + BACKWARD_FACTOR + c.score_passes) * branch_fwd + held_fwd
    if recompute:
        flops_branch += forward_flops(arch, params, R, P, lm_head=False, world=W)
    # exact: a backward of every chunk, and a recomputed forward of those not kept; replicated,
    # every rank recomputes and backpropagates every chunk; divided, its own tokens of each
    again = 1.0 if walk_recompute else 0.0
    if divided_walk:
        flops_exact_extra = (BACKWARD_FACTOR + 1 + again) * divided_walk_flops(arch, params, P, W, s.block,
                                                                       walk_chunk)
    else:
        # kept attention outputs: the recomputed forwards skip full attention over the prompt
        skipped = sum(kept_attention_flops(arch, layer, P) for layer in kept_output_layers(arch, P)) / W \
            if kept_outputs else 0.0
        flops_exact_extra = (BACKWARD_FACTOR * flops_prompt
                             + (1 + again) * (chunks - kept_chunks) / chunks * (flops_prompt - skipped))
    t_detached = (flops_capture + G * flops_branch) / thr  # FLOPs of one rank (see forward_flops)
    t_exact = t_detached + flops_exact_extra / thr
    t_transfer = offload["traffic_bytes"] / (c.host_bandwidth_gbs * 1e9) if offload else 0.0
    return Timing(throughput=thr, flops_capture=flops_capture, flops_branch=flops_branch,
                  flops_exact_extra=flops_exact_extra, t_detached=t_detached, t_exact=t_exact,
                  t_transfer=t_transfer)
