"""The planner's memory per rank: the prompt state (what capture keeps, sharded over the
ranks), weights / gradients / optimizer state, the working set of each pass (capture of
one chunk, replay of one branch or piece, exact mode's recompute of one chunk, a scoring
pass), state offload (`offload.py`), and the peak over phases (`peak.py`). Each section returns a dataclass.
Torch-free; the per-pass activation model is in `working.py`.

Legend: P prompt tokens, R response tokens, T tokens of one replayed piece, C tokens of one
capture chunk, W ranks; b / acc / rb bytes of the compute, accumulation and GDN recurrent
state dtypes (`config.Basis`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..parallel.deal import walk_chunk_tokens
from .arch import DTYPE_BYTES, QUANT_BYTES, Arch, LayerSpec, indexer_parameters
from .config import Basis
from .kept_outputs import kept_output_bytes
from .state_sizes import state_sizes
from .experts import divided_moe_working, expert_elements, expert_parallel_weights, fsdp2_expert_padding, weight_bytes
from .traffic import divided_capture_traffic, divided_walk_traffic
from .tree import takes_tree_path
from .divided_capture import divided_capture_working
from ..defaults import offloads_snapshots, recompute_pays, replay_batch_for
from .snapshots import (divided_walk_recompute_working, snapshot_grad_bytes, snapshot_plan, walk_recompute_working,
                        walk_starts)
from .working import autograd_pass, graph_bytes_per_token, nograd_layer_bytes, recompute_pass

# ----------------------------------------------------------------------------
# the prompt state


@dataclass(frozen=True)
class StatePlan:
    """The prompt state, bytes.

    Fields:
        sizes: per kind (`state_sizes`), with 'per_token' and 'fixed' (constant in P) totals.
        total: the whole prompt's state; rank: the fullest rank's (per-token part sharded 1/W).
        n_chunks: capture chunks of the prompt.
        checkpoints: exact mode's GDN snapshots at every chunk end but the last, per rank,
            on the device (one staged pair with `offload_snapshots`: `snapshots.py`).
        grad: exact mode's state gradients per rank (accumulated in fp32; fp64 under fp64):
            the per-token rows', and two snapshots' per recurrent layer.
        snapshots: exact mode's `snapshots.snapshot_plan` (None detached).
    """

    sizes: dict
    total: int
    rank: int
    n_chunks: int
    checkpoints: int
    grad: int
    snapshots: dict | None = None


def plan_state(s: Basis) -> StatePlan:
    """What capture keeps, on the whole and on the fullest rank."""
    exact, b, acc, P, p_rank = s.exact, s.b, s.acc, s.P, s.p_rank
    st = state_sizes(s.arch, b, s.rb, P, keep_windows=exact)
    # exact mode keeps the GDN snapshot at every chunk end of the WHOLE prompt on every rank
    # (the recurrent state is replicated, and every rank walks every chunk); the last one
    # is the state itself, already in the rank's state
    # (in host memory but one staged pair under offload_snapshots: `snapshots.py`)
    n_chunks = math.ceil(P / s.config.chunk_size)
    snaps = snapshot_plan(st, positions=P - 1, chunk=s.config.chunk_size, walk_starts=walk_starts_of(s),
                          offload=offloads_snapshots(s.config.offload_snapshots, exact, s.config.offload_state))
    checkpoints = snaps["device_bytes"] if exact else 0
    # state gradients accumulate in fp32 (fp64 for fp64) whatever the state dtype; the GDN
    # snapshots' gradients: two per layer at a time (the walk takes each once it seeds its chunk)
    grad = st["per_token"] * p_rank * acc // b + snapshot_grad_bytes(st, b, acc) if exact else 0
    return StatePlan(sizes=st, total=st["per_token"] * P + st["fixed"], rank=st["per_token"] * p_rank + st["fixed"],
                     n_chunks=n_chunks, checkpoints=checkpoints, grad=grad, snapshots=snaps if exact else None)


def walk_starts_of(s: Basis) -> int:
    """Recomputed walk chunks that start after 0 (each stages a snapshot back), by the
    engine's rules for a divided walk and kept graphs (`plan_walk`)."""
    c = s.config
    C = min(c.chunk_size, s.P)
    return walk_starts(s.P - 1, c.chunk_size, divided=walk_is_divided(s, kept_chunks(s, C)), world=s.W,
                       block=s.block, at_chunks=bool(s.arch.count(mixer="gdn")),
                       kept_chunks=kept_chunks(s, C))


# ----------------------------------------------------------------------------
# weights, gradients, optimizer


@dataclass(frozen=True)
class WeightPlan:
    """Weights, gradients and Adam state per rank, bytes (trainable: elements).

    Fields:
        base: the frozen (or trained) base weights, whole model.
        trainable: trained elements (LoRA adapters, or every parameter).
        param_bytes / grad_bytes / optimizer_bytes: per rank (sharded 1/W under shard_params).
        gathered: shard_params: two layers' weights gathered at a time (else 0).
        gathered_grads: shard_params: FSDP2's two buffers of a layer's backward, `plan/peak.py` (else 0).
        assumptions: the lines of the report these figures rest on.
    """

    base: float
    trainable: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    gathered: float
    assumptions: tuple
    gathered_grads: float = 0.0


def plan_weights(s: Basis) -> WeightPlan:
    """Weights, gradients and optimizer state of what is trained."""
    c, params, b, W, wdt, dtype = s.config, s.params, s.b, s.W, s.wdt, s.dtype
    assumptions = []
    if wdt in QUANT_BYTES:
        base = params.linear * QUANT_BYTES[wdt] + (params.embedding + params.lm_head + params.other) * b
        assumptions.append(f"{wdt} weights: every body linear (incl. experts) is quantized at "
                           f"{QUANT_BYTES[wdt]:.4f} B/param; embeddings, lm_head, norms, convs stay {dtype}")
    else:
        base = params.total * DTYPE_BYTES[wdt]
    half = b < 4
    adam = 8 + (4 if half else 0)
    if c.lora_rank:
        trainable = params.lora
        where = ("the token-mixer projections (attention q/k/v/o, GDN in/out, MLA q/kv/o)"
                 if c.lora_targets == "attention" else
                 "every linear except routed experts, routers, the DSA indexer and lm_head")
        assumptions.append(f"LoRA rank {c.lora_rank} on {where}; base weights frozen; adapters in the compute dtype")
    else:
        trainable = params.total
        assumptions.append("full training: every parameter trainable")
    param_bytes = base + (params.lora * b if c.lora_rank else 0)
    grad_bytes = trainable * b
    optimizer_bytes = trainable * adam
    assumptions.append(f"grads in {dtype}; Adam keeps 2 fp32 moments" + (" + an fp32 master copy" if half else "")
                       + f" = {adam} B per trainable parameter")
    gathered = gathered_grads = 0.0
    whole_trained = 0 if c.lora_rank else whole_elements(s.arch, params)  # FSDP2 wraps the decoder layers only
    if c.expert_parallel:  # plan/experts.py: each rank its experts' slice for good; the rest as below
        param_bytes, grad_bytes, optimizer_bytes, gathered = expert_parallel_weights(
            s.arch, base=base, lora_bytes=param_bytes - base, trainable=trainable, lora=bool(c.lora_rank), adam=adam,
            wdt=wdt, b=b, world=W, shard_params=c.shard_params, whole=whole_weight_bytes(s.arch, params, wdt, b),
            whole_trained=whole_trained)
        assumptions.append(f"expert parallelism: each rank holds ceil(E/W) = {math.ceil(s.arch.experts / W)} of "
                           f"{s.arch.experts} routed experts per MoE layer, never gathered; "
                           + ("the decoder layers' other weights, grads and optimizer state sharded 1/W (embeddings, "
                              "lm_head and the final norm whole), two layers' non-expert weights gathered at a time" if c.shard_params else "the other weights replicated"))
    elif c.shard_params:
        whole = whole_weight_bytes(s.arch, params, wdt, b)
        pad = fsdp2_expert_padding(s.arch, W)  # FSDP2 pads the experts' [E, ..] to a multiple of W
        param_bytes = whole + (param_bytes - whole) / W + weight_bytes(pad, 0, wdt, b)
        trained = whole_trained + (trainable - whole_trained) / W + (0 if c.lora_rank else pad)
        grad_bytes, optimizer_bytes = trained * b, trained * adam
        gathered = 2 * (base - whole) / len(s.arch.layers)  # two decoder layers'
        assumptions.append("shard_params: the decoder layers' weights, grads and optimizer state sharded 1/W "
                           "(FSDP2 wraps the layers only: embeddings, lm_head and the final norm stay whole on "
                           "every rank); two layers' weights gathered at a time (counted in the static memory); "
                           "in a layer's backward also its unsharded gradients and the last layer's reduce-scatter "
                           "input (two layers' gradients, in replay and the walk)")
    else:
        assumptions.append("weights, grads and optimizer state replicated on every rank")
    if c.shard_params:  # FSDP2's backward buffers: two of a layer's gradients (under expert parallelism, its non-expert part)
        own = expert_elements(s.arch) if c.expert_parallel and not c.lora_rank else 0
        gathered_grads = 2 * (trainable - whole_trained - own) / len(s.arch.layers) * b
    return WeightPlan(base=base, trainable=trainable, param_bytes=param_bytes, grad_bytes=grad_bytes,
                      optimizer_bytes=optimizer_bytes, gathered=gathered, assumptions=tuple(assumptions),
                      gathered_grads=gathered_grads)


def whole_elements(arch: Arch, params) -> int:
    """Elements FSDP2 leaves whole on every rank under `shard_params` (the engine wraps each
    decoder layer, `fully_shard(layer)`): the embeddings, lm_head and the final norm."""
    return params.embedding + params.lm_head + arch.hidden


def replicated_grad_elements(s: Basis) -> int:
    """Gradient elements of the parameters every rank holds whole (`parallel.gradients.
    replicated_parameters` that get a gradient), which a context-parallel step sums or
    broadcasts across ranks: LoRA's, or (FSDP2 reduce-scatters the sharded layers itself)
    the embeddings, lm_head and final norm, or every parameter but the DSA indexers' (no
    gradient) and the expert slices (never summed)."""
    c, params = s.config, s.params
    return (params.lora if c.lora_rank else whole_elements(s.arch, params) if c.shard_params
            else params.total - indexer_parameters(s.arch) - (expert_elements(s.arch) if c.expert_parallel else 0))


def whole_weight_bytes(arch: Arch, params, wdt: str, b: int) -> float:
    """Stored bytes of `whole_elements` (never quantized: the compute dtype under a quantized `wdt`)."""
    return whole_elements(arch, params) * (b if wdt in QUANT_BYTES else DTYPE_BYTES[wdt])


# ----------------------------------------------------------------------------
# working sets: replay, capture, the reverse walk, scoring


def _graph_tok(s: Basis) -> float:
    """Autograd graph bytes per token of one pass over every layer (plus the hidden rows)."""
    return (sum(graph_bytes_per_token(s.arch, l, s.b, s.config.gdn_kernel) for l in s.arch.layers)
            + 3 * s.arch.hidden * s.b)


def _autograd(s: Basis, tokens: int, keys: int, dense_self: bool | None = None) -> tuple[float, float]:
    """(graph, attention working) bytes of one autograd pass of `tokens` over `keys` (`working.py`);
    dense_self None: the config's self part (dense unless 'flash')."""
    dense = s.config.self_attention != "flash" if dense_self is None else dense_self
    return autograd_pass(s.arch, tokens, keys, s.config.attention_block_size, s.b, s.acc, dense,
                         s.config.gdn_kernel)


def nograd_working(s: Basis, tokens: int) -> float:
    """One no-grad pass of `tokens` queries over the rank's prompt: the largest layer."""
    c = s.config
    fused = c.self_attention != "dense"  # capture through a fused kernel
    return max(nograd_layer_bytes(s.arch, l, tokens, s.p_rank, c.attention_block_size, s.acc, s.b, c.gdn_kernel,
                                  fused=fused)
               for l in s.arch.layers)


@dataclass(frozen=True)
class ReplayPlan:
    """Replay of one branch (or one piece of it) with autograd, bytes.

    Fields:
        T: tokens of one replayed piece; held: branch tokens held as a state while the
            pieces are walked back (0 for one piece).
        graph_tok: graph bytes per token of one pass.
        recompute: each layer recomputed in backward (`ExecConfig.recompute_layers`).
        graph / attention / logits: the piece's graph (with recompute: every layer's
            input and the largest layer's activations), its blockwise-attention working set,
            the chunked-logits working set.
        branch_state: the earlier pieces' state (and their gradient buffers).
        working: graph + the larger of attention and logits + branch_state (with recompute:
            the layers' inputs + the larger of one layer's backward moment and the logits,
            `working.recompute_pass`).
        layers_working: `working` at a layer's backward moment, the logits left out (where
            FSDP2's backward buffers join, `plan/peak.py`).
    """

    T: int
    held: int
    graph_tok: float
    recompute: bool
    graph: float
    attention: float
    logits: float
    branch_state: float
    working: float
    layers_working: float | None = None  # None: `working`
    batch: int = 1


def plan_replay(s: Basis, state: StatePlan) -> ReplayPlan:
    """One branch's replay: its piece's graph over the rank's prompt shard and held pieces."""
    c, R, b, arch, st = s.config, s.R, s.b, s.arch, state.sizes
    T = min(R, c.branch_chunk_size or R)  # tokens in one replayed piece
    held = (R - 1) // T * T if T < R else 0  # branch tokens held as a state while pieces are walked back
    batch = replay_batch(s, state, T)
    rows = T * batch  # a batch of one-piece branches
    # under CP a rank's queries read its own shard of the prompt (plus the branch's held pieces)
    graph, attn = _autograd(s, rows, s.p_rank + held)
    logits = min(T, c.logits_chunk_size) * arch.vocab * (b + 3 * 4) + rows * arch.hidden * b + head_grad_transient(s, T)
    # the earlier pieces' state (and the recurrent state at each piece start), with grad buffers
    branch_state = 2 * (st["per_token"] * held + held // T * (st["recurrent_fixed"] + st["conv_tail_fixed"]))
    working, layers = graph + max(attn, logits), graph + attn
    recompute = recompute_pays(c.recompute_layers, graph, held_bytes(s, state), len(arch.layers))
    if recompute:  # the layers' inputs, then one layer's graph at a time (its backward), or the logits
        kept, moment, layer_graph = recompute_pass(arch, rows, s.p_rank + held, c.attention_block_size, b, s.acc,
                                                   c.self_attention != "flash", c.gdn_kernel)
        graph, working, layers = kept + layer_graph, kept + max(moment, logits), kept + moment
    return ReplayPlan(T=T, held=held, graph_tok=_graph_tok(s), recompute=recompute, graph=graph, attention=attn,
                      logits=logits, branch_state=branch_state, working=working + branch_state,
                      layers_working=layers + branch_state, batch=batch)


def batches_replay(arch: Arch) -> bool:
    """Whether every mixer takes a batch of branches (`Adapter.batches_replay`): not Mamba2, KDA."""
    return all(layer.mixer in ("attention", "mla") or (layer.mixer == "gdn" and arch.recurrent == "gdn")
               for layer in arch.layers)


def replay_batch(s: Basis, state: StatePlan, T: int) -> int:
    """Branches replayed as one batch, pieces of `T` tokens (as `engine/batched.batch_size`): 1 in
    pieces, a shared tree or images; else `defaults.replay_batch_for` (free: a kept walk chunk)."""
    c = s.config
    if T != s.R or takes_tree_path(c) or c.images:
        return 1
    batches = c.replay_batch is None and c.gpus == 1 and batches_replay(s.arch)
    free = min(c.chunk_size, s.P - 1) if batches and s.exact and s.P > 1 and walk_keeps_graph(s, state) else 0
    return replay_batch_for(c.replay_batch, group=s.G, batches=batches, response_tokens=T, free_tokens=free)


def walk_keeps_graph(s: Basis, state: StatePlan) -> bool:
    """No layer recompute in exact mode's walk (`Engine.walk_recomputes_layers`: chunks of min(C, P - 1))."""
    walk_graph = _autograd(s, min(s.config.chunk_size, s.P - 1), s.p_rank)[0]  # one undivided walk chunk's graph
    return not recompute_pays(s.config.recompute_layers, walk_graph, held_bytes(s, state), len(s.arch.layers))


def head_grad_transient(s: Basis, tokens: int | None = None) -> float:
    """Bytes of lm_head's weight gradient computed apart (an mm over the logits chunk's
    rows) before autograd adds it into the existing `.grad`: full training, once a
    gradient exists (every branch after the first, or a later group of a batch); the
    tied embedding when lm_head is tied. Found on tiny qwen3 (one layer, vocab 4,096):
    a [4096, 256] fp32 mm output alive at the replay peak (4 MiB), not planned before.

    A piece of `tokens` tokens runs lm_head in ceil(tokens / logits_chunk_size) chunks
    (`engine/logprobs.py`): autograd's input buffer of the weight holds the first chunk's
    gradient while the next chunk's is computed, so two are alive at once where there are
    two chunks or more. Found by rehearsing Qwen3.6-27B (pieces of 2,048, chunks of 1,024):
    four [248320, 5120] bf16 tensors made in the walk alive at the replay peak (the two
    gradients and two transients), 2.37 GB more than one transient planned."""
    c = s.config
    if c.lora_rank or (s.G < 2 and c.tree is None and not c.grads_during_capture):
        return 0.0
    chunks = 1 if tokens is None else -(-tokens // c.logits_chunk_size)
    return min(2, chunks) * (s.params.lm_head or s.params.embedding) * s.b


def held_bytes(s: Basis, state: StatePlan) -> float:
    """What the step holds anyway on the fullest rank, the yardstick of `recompute_pays`
    (as `Engine.held_bytes`): weights, their gradients, the prompt state and (exact mode)
    its gradients and device snapshots. The optimizer state is not counted (the engine
    does not see it)."""
    w = plan_weights(s)
    return w.param_bytes + w.grad_bytes + state.rank + state.grad + state.checkpoints


WALK_ATTENTION_KEPT_ROWS = 3
WALK_ATTENTION_BACKWARD_ROWS = 7
"""A divided walk's attention layer, per chunk token, in [H, Dv + 1] acc rows: 3 kept from the
forward (own causal parts gathered, the shard's part, the merge) and 7 more in its backward,
counted from a rehearsal's live set at the walk's peak (`bench/rehearse_attribution.py`,
Qwen3.6-27B cut to 8 layers, P = 262,144, 8 ranks, chunks of 16,384; docs/rehearse.md)."""


def walk_attention_backward_bytes(arch: Arch, layer: LayerSpec, acc: int) -> float:
    """Bytes per chunk token a divided walk's attention layer holds only in its backward
    (`WALK_ATTENTION_BACKWARD_ROWS`); 0 for other mixers. The last layer has none: no root
    reaches its output (a walk has no loss on the prompt), so its attention runs no backward."""
    return WALK_ATTENTION_BACKWARD_ROWS * arch.heads * (arch.head_dim + 1) * acc if layer.mixer == "attention" else 0.0


def _gathered_walk_row_bytes(arch: Arch, layer: LayerSpec, b: int, gk: bool, acc: int) -> float:
    """Bytes per chunk token a divided reverse walk's layer keeps for the whole chunk (its
    rows of every rank, gathered, and the chunk's output that every rank computes):
    attention q/k/v and output; MLA the absorbed queries and latent rows, and the latent
    output (the indexer's gathered inputs take no grad and are freed with the layer); GDN
    its replicated conv + recurrence (`models/gated_deltanet.divided_recompute_gdn`): the
    gathered projected rows, the conv's output before and after its activation, and the
    decay and write strength the kernel keeps (its registered op keeps only its inputs;
    the rest of the layer runs on the own rows). Other recurrent mixers: the layer's graph."""
    if layer.mixer == "attention":  # q, k, v gathered; the output's rows in acc
        return ((arch.heads + 2 * arch.kv_heads) * arch.head_dim * b
                + WALK_ATTENTION_KEPT_ROWS * arch.heads * (arch.head_dim + 1) * acc)
    if layer.mixer == "mla":
        kl, r = arch.kv_lora_rank, arch.rope_dim
        return ((arch.heads + 1) * (kl + r) + arch.heads * kl) * b
    if layer.mixer == "gdn" and arch.recurrent == "gdn" and gk == "torch":
        hv = arch.gdn_v_heads
        return (3 * arch.conv_dim + 3 * hv) * b + 4 * hv * max(4, b)
    return graph_bytes_per_token(arch, layer, b, gk)


@dataclass(frozen=True)
class CapturePlan:
    """Capture of the prompt without autograd.

    Fields:
        C: tokens of one capture (and recompute) chunk: every rank runs every chunk's tokens.
        divided: each prompt token computed on one rank (the engine's `divides_capture`).
        working: the larger of one chunk's no-grad pass and (divided) one layer's pass over
            the rank's positions, bytes.
        comm: bytes the busiest rank receives (divided; else 0).
    """

    C: int
    divided: bool
    working: float
    comm: float


def plan_capture(s: Basis) -> CapturePlan:
    """Capture's working set, and whether (and at what traffic) it is divided."""
    c, W, P = s.config, s.W, s.P
    C = min(c.chunk_size, P)  # capture / recompute chunk: every rank runs every chunk's tokens
    # the engine's rule (Engine.divides_capture): not with kept chunk graphs, and only when
    # every rank owns a block (an offloaded state too: each rank writes its rows to host)
    divided = (c.divide_capture and W > 1
               and not (c.mode == "exact" and c.keep_graph_bytes > 0) and s.every_rank_owns)
    working, comm = nograd_working(s, C), 0.0
    if divided:  # layer by layer over the rank's positions: its hidden shard and one layer's projections
        working = max(working, divided_capture_working(s.arch, s.p_rank, C, s.b, s.acc))
        if c.expert_parallel:  # an MoE piece holds every rank's gathered tokens (plan/experts.py)
            working = max(working, divided_moe_working(s.arch, min(C, s.p_rank), W, s.b))
        comm = divided_capture_traffic(s.cfg, positions=P - 1, world=W, block=s.block,
                                       chunk_size=c.chunk_size, dtype=s.dtype, exact=s.exact)
    return CapturePlan(C=C, divided=divided, working=working, comm=comm)


@dataclass(frozen=True)
class WalkPlan:
    """Exact mode's reverse walk (and its kept capture graphs).

    Fields:
        working: recompute of one chunk with autograd, bytes (0 detached).
        chunks: capture chunks of the P - 1 captured positions.
        chunk_graph: one chunk's autograd graph, bytes.
        kept_chunks / kept_bytes: the last chunks whose graphs are kept instead of recomputed.
        divided: each prompt token recomputed on one rank (the engine's `divides_walk`).
        chunk: tokens of one walk chunk (whole deal cycles when divided, else C).
        comm: bytes each rank receives in the divided walk (else 0).
        recompute: each decoder layer recomputed in backward (`Engine.walk_recomputes_layers`).
        transient: the blockwise attention's backward transient of one chunk (a kept graph's
            backward holds it).
        kept_outputs: `keep_attention_outputs`: the full-attention layers' outputs and LSEs
            of the recomputed chunks, bytes (0 without; alive from capture to the walk).
    """

    working: float
    chunks: int
    chunk_graph: float
    kept_chunks: int
    kept_bytes: float
    divided: bool
    chunk: int
    comm: float
    recompute: bool = False
    transient: float = 0.0
    kept_outputs: float = 0.0


def _divided_walk_working(s: Basis, walk_chunk: int, graph_tok: float) -> float:
    """The rank's own tokens of one walk chunk with autograd, plus the chunk's gathered q/k/v
    and output rows per attention layer and its replicated attention (self part, blockwise
    backward), and per GDN layer its replicated conv + recurrence (bounded by the layer's
    whole graph per token)."""
    own = s.deal.fullest(walk_chunk)
    gathered_rows = walk_chunk * (sum(_gathered_walk_row_bytes(s.arch, layer, s.b, s.config.gdn_kernel, s.acc)
                                      for layer in s.arch.layers)
                                  + max((walk_attention_backward_bytes(s.arch, layer, s.acc)
                                         for layer in s.arch.layers[:-1]), default=0.0))
    whole, attn = _autograd(s, walk_chunk, s.p_rank)
    self_part = whole - walk_chunk * graph_tok  # the dense self part's scores, when counted
    return _autograd(s, own, s.p_rank, dense_self=False)[0] + gathered_rows + self_part + attn


def plan_walk(s: Basis, capture: CapturePlan, graph_tok: float) -> WalkPlan:
    """Exact mode's recompute working set, kept graphs, and whether the walk is divided."""
    c, W, P, C, exact = s.config, s.W, s.P, capture.C, s.exact
    graph, transient = _autograd(s, C, s.p_rank)
    recompute = exact and not walk_keeps_graph(s, plan_state(s))  # the engine's rule; FSDP2 too
    working = (walk_recompute_working(s, C, s.p_rank) if recompute else graph + transient) if exact else 0.0
    # exact mode's kept capture graphs (the last chunks that fit), alive from capture to their walk
    chunks = -(-max(P - 1, 1) // C)
    chunk_graph = graph
    kept = kept_chunks(s, C)
    divided = walk_is_divided(s, kept)
    walk_chunk, comm = C, 0.0
    if divided:
        walk_chunk = walk_chunk_tokens(P - 1, c.chunk_size, W, s.block,
                                       bool(s.arch.count(mixer="gdn")))
        working = (divided_walk_recompute_working(
            s, walk_chunk, s.deal.fullest(walk_chunk),
            lambda layer: _gathered_walk_row_bytes(s.arch, layer, s.b, c.gdn_kernel, s.acc),
            lambda layer: walk_attention_backward_bytes(s.arch, layer, s.acc)) if recompute
            else _divided_walk_working(s, walk_chunk, graph_tok))
        comm = divided_walk_traffic(s.cfg, positions=P - 1, world=W, block=s.block, chunk_size=c.chunk_size,
                                    dtype=s.dtype, grad_bytes=replicated_grad_elements(s) * s.b, recompute=recompute)
    outputs = kept_output_bytes(s, (P - 1) - min(P - 1, kept * C)) if exact and not divided else 0.0
    return WalkPlan(working=working, chunks=chunks, chunk_graph=chunk_graph, kept_chunks=kept,
                    kept_bytes=kept * chunk_graph, divided=bool(divided), chunk=walk_chunk, comm=comm,
                    recompute=recompute, transient=transient, kept_outputs=outputs)


def kept_chunks(s: Basis, C: int) -> int:
    """Exact mode's kept capture graphs: the last chunks whose graphs fit `keep_graph_bytes`
    (none under FSDP2: the engine's capture keeps no graph there, `engine/capture.py`)."""
    c = s.config
    if not (s.exact and c.keep_graph_bytes) or c.shard_params:
        return 0
    return min(-(-max(s.P - 1, 1) // C), int(c.keep_graph_bytes // _autograd(s, C, s.p_rank)[0]))


def walk_is_divided(s: Basis, kept: int) -> bool:
    """The engine's rule (Engine.divides_walk): no kept chunk graphs, no offloaded state, a
    block for every rank (sharded weights: FSDP2 over the W ranks, whose reduce-scatter
    then sums)."""
    c = s.config
    return bool(s.exact and c.divide_walk and s.W > 1 and not c.offload_state and kept == 0 and s.every_rank_owns)


def score_working(s: Basis) -> float:
    """One whole branch without autograd; fp32 logits + log-softmax of one chunk (0 without score passes)."""
    c, R = s.config, s.R
    if not c.score_passes:
        return 0.0
    return nograd_working(s, R) + min(R, c.logits_chunk_size) * s.arch.vocab * (s.b + 2 * 4)
