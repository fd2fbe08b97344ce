"""The capacity planner's estimate: memory per rank (static + the largest working set
of capture, replay, recompute) and time from FLOPs, for one GRPO step; and its report.
The architecture side (configs, presets, parameter counts) is in `arch.py`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import ConfigError
from .arch import (
    BACKWARD_FACTOR,
    DTYPE_BYTES,
    GDN_KERNELS,
    LORA_TARGETS,
    QUANT_BYTES,
    SELF_ATTENTION,
    Arch,
    LayerSpec,
    ParamCount,
    architecture,
    canonical_dtype,
    count_parameters,
    indexer_parameters,
    human_bytes,
    load_model_config,
    parse_bytes,
)
from .offload import offload_plan
from .working import autograd_pass, graph_bytes_per_token, nograd_layer_bytes

# ----------------------------------------------------------------------------
# the plan


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """One GRPO step to plan for (see docs/planner.md)."""

    prompt_tokens: int
    """P: tokens of the shared prompt. The state is counted for all P positions (capture
    keeps P - 1; the last prompt token is replayed with each branch)."""

    group: int = 8
    """G: responses in the group (replayed one at a time: memory does not grow with G)."""

    response_tokens: int = 1024
    """R: tokens per response."""

    mode: str = "detached"
    """"detached" (the paper's gradient) or "exact" (gradients through the prompt state)."""

    gpus: int = 1
    """W: context-parallel ranks. Per-token state is sharded 1/W; constant state, weights,
    gradients and optimizer state are replicated (unless `shard_params`)."""

    gpu_memory: int | str = "96GiB"
    """Memory per rank; '96GB' is 96e9 bytes and '96GiB' is 96 * 2**30."""

    reserve: int | str = "1GiB"
    """Headroom not counted in the peak (CUDA context, allocator fragmentation);
    `fits` is peak + reserve <= gpu_memory."""

    dtype: str | None = None
    """Compute / activation / state dtype (bf16, fp16, fp32, fp64). None: the config's
    torch_dtype, else bf16. The GDN recurrent state is fp32 (fp64 under fp64) regardless."""

    weight_dtype: str | None = None
    """Storage of the frozen base weights: a dtype, or nf4 / fp8 / int8 for the body's
    linear weights (embeddings, lm_head and norms stay in `dtype`). None: `dtype`.
    Quantized weights need `lora_rank`."""

    lora_rank: int | None = None
    """Train LoRA adapters of this rank (base frozen) instead of the whole model."""

    lora_targets: str = "attention"
    """'attention': the token-mixer projections of every layer; 'all-linear': also the
    dense MLP and shared-expert projections (what the paper's 116.7M at rank 16 counts)."""

    chunk_size: int = 4096
    """Capture chunk (ExecConfig.chunk_size)."""

    branch_chunk_size: int | None = None
    """Replay each branch in pieces of this many tokens (ExecConfig.branch_chunk_size;
    the paper: 2048). None: one piece of R tokens."""

    attention_block_size: int = 1024
    """Prompt positions per block of the blockwise attention (ExecConfig)."""

    logits_chunk_size: int = 1024
    """Response tokens per lm_head + log-softmax chunk (ExecConfig)."""

    self_attention: str = "flash"
    """How a replayed piece or a captured chunk attends to itself (and, without
    autograd, to the prompt). 'flash' (today's code): the blockwise causal kernel with
    recompute, O(T) kept and an O(T x block) working set, in every pass. 'dense': plain
    torch [heads, T, T] fp32 scores and probabilities per attention layer (LongStraw
    before the blockwise self part; kept to compare). 'fused-nograd': a fused capture
    with dense autograd passes."""

    gdn_kernel: str = "torch"
    """Chunked gated-delta kernel of GDN layers: 'torch' (ops/gated_delta.py, fp32
    arithmetic; what runs without flash-linear-attention, and on CPU) or 'fla'
    (flash-linear-attention, used on CUDA in bf16/fp16 when installed; a smaller working
    set, not measured by us). The default is the larger, measured one."""

    grads_during_capture: bool = True
    """Parameter gradients already exist while the prompt is captured: true for every
    group after the first of a batch (they accumulate until the optimizer step), so the
    safe default. False: the first group after `zero_grad(set_to_none=True)`, whose
    gradient buffers appear only in its first backward (what a one-group benchmark sees)."""

    shard_params: bool = False
    """Shard weights, gradients and optimizer state 1/W over the ranks (FSDP / ZeRO-3
    style; two layers' weights gathered at a time) instead of replicating them."""

    offload_state: bool = False
    """Keep the prompt state's per-token rows (and exact mode's gradients for them) in
    host memory, staged to the device one layer at a time (`ExecConfig(state_device=
    "cpu")`, the paper's GLM-5.2 run): the device holds two layers' rows (the running one
    and the prefetched next), and each pass moves every staged layer's rows over the
    host link (`plan/offload.py`)."""

    host_bandwidth_gbs: float = 50.0
    """Host <-> device bandwidth in GB/s (1e9 B/s) for the offload traffic's time (50: a
    PCIe Gen5 x16 link in practice; an H200 NVL / GH200 host link is faster)."""

    score_passes: int = 0
    """No-grad forwards of each branch that score old / reference log-probs from the one
    captured prompt state (`Engine.score(group, state=...)` reusing the step's capture):
    no second capture. The paper's recipe: 2 (old + reference). On-policy with beta = 0:
    0. Adds time, and a (small) no-grad working set."""

    keep_graph_bytes: int | str = 0
    """Exact mode (`ExecConfig.keep_graph_bytes`): bytes of capture-chunk autograd graphs
    kept instead of recomputed. The planner keeps as many of the last chunks as fit at its
    estimate of one chunk's graph; they are alive from capture to the reverse walk."""

    divide_capture: bool = True
    """Under context parallelism (W > 1), capture computes each prompt token on one rank
    (`ExecConfig.divide_capture`; every family, but not with kept graphs or an offloaded
    state, and only when every rank owns a block). False: capture's token computation is
    replicated on every rank."""

    divide_walk: bool = True
    """Exact mode under context parallelism (W > 1): the reverse walk recomputes and
    backpropagates each prompt token on one rank (`ExecConfig.divide_walk`; every family,
    also with `shard_params`; not with kept graphs or an offloaded state, and only when
    every rank owns a block).
    False: the walk's token computation is replicated on every rank."""

    throughput_tflops: float = 400.0
    """Effective dense throughput per rank, TFLOP/s (default 400: an H100/H200-class GPU
    at ~40-50% of its bf16 peak; an H20 is ~148 peak)."""

    def __post_init__(self):
        for name in ("prompt_tokens", "group", "response_tokens", "gpus", "chunk_size", "attention_block_size",
                     "logits_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PlanConfig.{name} must be a positive int, got {value!r}")
        for name in ("lora_rank", "branch_chunk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"PlanConfig.{name} must be a positive int or None, got {value!r}")
        if isinstance(self.score_passes, bool) or not isinstance(self.score_passes, int) or self.score_passes < 0:
            raise ConfigError(f"PlanConfig.score_passes must be an int >= 0, got {self.score_passes!r}")
        if not (isinstance(self.host_bandwidth_gbs, (int, float)) and math.isfinite(self.host_bandwidth_gbs)
                and self.host_bandwidth_gbs > 0):
            raise ConfigError(f"PlanConfig.host_bandwidth_gbs must be a number > 0, got {self.host_bandwidth_gbs!r}")
        if self.mode not in ("detached", "exact"):
            raise ConfigError(f"PlanConfig.mode must be 'detached' or 'exact', got {self.mode!r}")
        if self.lora_targets not in LORA_TARGETS:
            raise ConfigError(f"PlanConfig.lora_targets must be one of {LORA_TARGETS}, got {self.lora_targets!r}")
        if self.gdn_kernel not in GDN_KERNELS:
            raise ConfigError(f"PlanConfig.gdn_kernel must be one of {GDN_KERNELS}, got {self.gdn_kernel!r}")
        if self.self_attention not in SELF_ATTENTION:
            raise ConfigError(f"PlanConfig.self_attention must be one of {SELF_ATTENTION}, got {self.self_attention!r}")
        if not (isinstance(self.throughput_tflops, (int, float)) and math.isfinite(self.throughput_tflops)
                and self.throughput_tflops > 0):
            raise ConfigError(f"PlanConfig.throughput_tflops must be a number > 0, got {self.throughput_tflops!r}")
        self.gpu_memory = parse_bytes(self.gpu_memory)
        self.reserve = parse_bytes(self.reserve)
        self.keep_graph_bytes = parse_bytes(self.keep_graph_bytes)
        if self.offload_state and self.keep_graph_bytes:
            raise ConfigError("PlanConfig.offload_state with keep_graph_bytes: the engine refuses kept capture "
                              "graphs with an offloaded state (ExecConfig); drop one of them")
        if self.dtype is not None:
            self.dtype = canonical_dtype(self.dtype)
        if self.weight_dtype is not None:
            self.weight_dtype = canonical_dtype(self.weight_dtype, allow_quant=True)
            if self.weight_dtype in QUANT_BYTES and not self.lora_rank:
                raise ConfigError(f"weight_dtype {self.weight_dtype!r} stores frozen base weights: "
                                  "full training needs a float dtype; pass lora_rank for (Q)LoRA")


def _state_sizes(arch: Arch, b: int, rb: int, prompt: int, layers=None, keep_windows: bool = False) -> dict:
    """Per-token and constant state bytes by kind, over `layers` (default: all).
    b: state dtype bytes; rb: recurrent state bytes. keep_windows: sliding-window layers
    keep every position (exact mode: the reverse walk recomputes every chunk)."""
    s = {"attention_kv_per_token": 0, "mla_latent_per_token": 0, "indexer_keys_per_token": 0,
         "window_kv_fixed": 0, "recurrent_fixed": 0, "conv_tail_fixed": 0}
    kv = arch.kv_heads * 2 * arch.head_dim * b  # K and V per position
    for layer in arch.layers if layers is None else layers:
        if layer.mixer == "attention":
            if layer.window is None or keep_windows:
                s["attention_kv_per_token"] += kv
            else:
                s["window_kv_fixed"] += min(layer.window - 1, prompt) * kv
        elif layer.mixer == "gdn":
            s["recurrent_fixed"] += arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * rb
            s["conv_tail_fixed"] += arch.conv_dim * (arch.gdn_kernel - 1) * b
        else:
            s["mla_latent_per_token"] += (arch.kv_lora_rank + arch.rope_dim) * b
            s["indexer_keys_per_token"] += arch.index_dim * b if layer.indexer else 0
    s["per_token"] = s["attention_kv_per_token"] + s["mla_latent_per_token"] + s["indexer_keys_per_token"]
    s["fixed"] = s["window_kv_fixed"] + s["recurrent_fixed"] + s["conv_tail_fixed"]
    return s


def _pairs(n_q: int, prefix: int, limit: int | None) -> float:
    """Query-key pairs of n_q causal queries that follow `prefix` keys, each seeing at
    most `limit` keys (None: all)."""
    total = n_q * prefix + n_q * (n_q + 1) / 2
    if limit is None:
        return total
    # query i (0-based, at absolute position prefix + i) sees min(prefix + i + 1, limit) keys
    first_capped = max(0, limit - prefix - 1)  # queries before this one see < limit keys
    uncapped = min(n_q, first_capped)
    return uncapped * prefix + uncapped * (uncapped + 1) / 2 + (n_q - uncapped) * limit


def _mixer_flops(arch: Arch, layer: LayerSpec, n_q: int, prefix: int) -> float:
    """Forward FLOPs of the token mixer beyond its projections: QK^T and PV (2 flops per
    multiply-add) for n_q queries after `prefix` positions. Causal prompt, dense layer:
    2 * (d_qk + d_v) * heads * P^2 / 2 = 4 * P^2 / 2 * heads * head_dim."""
    if layer.mixer == "attention":
        return 2 * arch.heads * 2 * arch.head_dim * _pairs(n_q, prefix, layer.window)
    if layer.mixer == "gdn":  # state update + readout, ~4 * v_heads * dk * dv per token
        return 4 * arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * n_q
    kl, r = arch.kv_lora_rank, arch.rope_dim
    f = 2 * arch.heads * (2 * kl + r) * _pairs(n_q, prefix, arch.index_topk if layer.sparse else None)
    if layer.indexer:
        f += 2 * arch.index_heads * arch.index_dim * _pairs(n_q, prefix, None)
    return f


def _forward_flops(arch: Arch, params: ParamCount, n_q: int, prefix: int, lm_head: bool, world: int = 1) -> float:
    """Forward FLOPs one rank runs: the token computation (projections, MLP/MoE, GDN,
    lm_head) is replicated on every rank under context parallelism; only attention
    over the (sharded) prompt state is divided by `world`."""
    f = 2 * params.matmul_active * n_q + (2 * arch.vocab * arch.hidden * n_q if lm_head else 0)
    return f + sum(_mixer_flops(arch, layer, n_q, prefix) / (1 if layer.mixer == "gdn" else world)
                   for layer in arch.layers)


def divided_flops(arch: Arch, params: ParamCount, positions: int, world: int, block: int) -> float:
    """Forward FLOPs of a divided capture on the fullest rank: the token computation of its
    own positions (each prompt token on one rank), attention of its queries over every
    earlier position (the round-robin deal balances it: ~1/W of the causal pairs), and for
    GDN layers the affine transition ((Dk + Dv) / Dv of one pass of the recurrence) plus
    the read of each start state (2 Dk Dv per head and token)."""
    mine = rank_positions(positions, world, block)
    f = 2 * params.matmul_active * mine
    for layer in arch.layers:
        if layer.mixer == "gdn":
            f += _mixer_flops(arch, layer, mine, 0) * (arch.gdn_k_dim + arch.gdn_v_dim) / arch.gdn_v_dim
            f += 2 * arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * mine
        else:
            f += _mixer_flops(arch, layer, positions, 0) / world
    return f


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
    blocks = -(-positions // block)
    per_rank_blocks = -(-blocks // world)
    snapshots = len(range(chunk_size, positions, chunk_size)) + 1 if exact else 1
    worst = 0.0
    for rank in range(world):
        mine = rank_positions_of(positions, world, block, rank)
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


def walk_chunk_tokens(positions: int, chunk_size: int, world: int, block: int, at_chunks: bool = False) -> int:
    """Tokens of one chunk of a divided reverse walk: whole cycles of the deal (world x
    block), as many as `chunk_size` needs; `at_chunks` (GDN hybrids): the fewest capture
    chunks that hold a cycle. `parallel.divided.walk_chunks` cuts the walk with it."""
    cycle = world * block
    size = -(-cycle // chunk_size) * chunk_size if at_chunks else -(-chunk_size // cycle) * cycle
    return min(positions, size)


def walk_chunk_bounds(positions: int, chunk_size: int, world: int, block: int,
                      at_chunks: bool = False) -> list[tuple[int, int]]:
    """The chunks [(start, end)] of a divided reverse walk (`walk_chunk_tokens` each); a
    shorter last chunk in which some rank would own no block joins the one before it.
    `parallel.divided.walk_chunks` walks exactly these."""
    size = walk_chunk_tokens(positions, chunk_size, world, block, at_chunks)
    bounds = [(a, min(positions, a + size)) for a in range(0, positions, size)]
    a, b = bounds[-1]
    if len(bounds) > 1 and len({k % world for k in range(a // block, (b - 1) // block + 1)}) < world:
        bounds[-2:] = [(bounds[-2][0], positions)]
    return bounds


def divided_walk_traffic(model, *, positions: int, world: int, block: int, chunk_size: int,
                         dtype: str | None = None, grad_bytes: float | None = None) -> float:
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
                    apart); else (sparse DSA) every rank's top-k candidates per query and
                    each rank's own rows' selection (an own indexer; all-gathers), the
                    shard's sparse partials (merged) and dq
                    (all-reduce); the output gradient (all-reduce)

    (the backward's all-reduces for every layer but the last, whose output reaches no
    root of a walk chunk), plus, once per step, the all-reduce of the replicated parameters' gradients
    (`grad_bytes`, default: every parameter but the DSA indexers', in `dtype`). Partials and log-sum-exps are in
    the accumulation dtype (fp32 for half types); the gradients summed over ranks in
    `dtype` (the blockwise kernel's, as on GPU; the CPU fused kernel sums the attention's
    dq, dk, dv in its accumulation dtype, the same bytes in fp32 and fp64)."""
    arch, b, acc = _arch_and_bytes(model, dtype)
    if world == 1:
        return 0.0
    gathered, summed = world - 1, 2 * (world - 1) / world  # all-gather and ring all-reduce, per byte
    h, hkv, d = arch.heads, arch.kv_heads, arch.head_dim
    kl, r = arch.kv_lora_rank, arch.rope_dim
    total = 0.0
    for a, e in walk_chunk_bounds(positions, chunk_size, world, block, bool(arch.count(mixer="gdn"))):
        t = e - a
        most = max(rank_positions_of(e, world, block, s) - rank_positions_of(a, world, block, s) for s in range(world))
        for i, layer in enumerate(arch.layers):
            # the last layer's output reaches no root of a walk chunk (only its state rows are
            # seeded), so its backward exchanges nothing
            back = i < len(arch.layers) - 1
            if layer.mixer == "attention":
                total += gathered * most * ((h + 2 * hkv) * d * b + h * (d + 1) * acc)
                total += back * summed * t * (2 * hkv * d + h * d) * b  # the self part's dk, dv; the output's
                if a > 0:  # the shard's partials merged (max, then sum: [H, T, D + 2]) and their dq
                    total += summed * h * t * (d + 2) * acc + back * summed * h * t * d * b
            elif layer.mixer == "gdn":
                total += gathered * most * (arch.conv_dim + 2 * arch.gdn_v_heads) * b
                total += back * summed * t * arch.gdn_v_heads * arch.gdn_v_dim * b
            else:
                total += gathered * most * (h + 1) * (kl + r) * b + back * summed * h * t * kl * b
                if layer.indexer:
                    total += gathered * most * ((arch.index_heads + 1) * arch.index_dim * b + arch.index_heads * 4)
                if not layer.sparse or arch.index_topk >= e:
                    total += gathered * most * h * (kl + 1) * acc + back * summed * t * (2 * kl + r) * b
                    if a > 0:
                        total += summed * h * t * (kl + 2) * acc + back * summed * h * t * (kl + r) * b
                else:
                    if layer.indexer:  # every rank's candidates for the chunk; each rank's rows' selection
                        total += gathered * t * arch.index_topk * (4 + 4) + gathered * most * arch.index_topk * 4
                    total += summed * h * t * (kl + 2) * acc + back * summed * h * t * (kl + r) * b
    if grad_bytes is None:
        grad_bytes = (count_parameters(arch).total - indexer_parameters(arch)) * b
    return total + gathered * 16 + summed * grad_bytes


def own_self_pairs(chunk: int, world: int, block: int) -> float:
    """Causal (query, key) pairs of one walk chunk's self part on the fullest rank, when
    each rank attends for its own query rows only (blocks dealt round-robin from the
    chunk's start): a block at chunk offset a sees a * B + B (B + 1) / 2 pairs."""
    blocks = [(a, min(chunk, a + block)) for a in range(0, chunk, block)]
    return max(sum(a * (b - a) + (b - a) * (b - a + 1) / 2 for i, (a, b) in enumerate(blocks) if i % world == r)
               for r in range(world))


def divided_walk_flops(arch: Arch, params: ParamCount, positions: int, world: int, block: int,
                       chunk: int) -> float:
    """Forward FLOPs of a divided reverse walk's recompute on the fullest rank: the token
    computation of its own positions, ~1/W of the attention pairs over earlier chunks, each
    chunk's own causal part for its own query rows (`own_self_pairs`; DSA layers: every
    rank runs the chunk's sparse self part and top-k in full), and every GDN layer's
    recurrence over every position (it runs over each whole walk chunk on every rank)."""
    chunks = -(-positions // chunk)
    f = 2 * params.matmul_active * rank_positions(positions, world, block)
    for layer in arch.layers:
        whole, self_part = _mixer_flops(arch, layer, positions, 0), _mixer_flops(arch, layer, chunk, 0)
        if layer.mixer == "gdn":
            f += whole
        elif layer.sparse:
            f += whole / world + chunks * self_part * (1 - 1 / world)
        else:  # the self part's share of the rank's own query rows
            own = self_part * own_self_pairs(chunk, world, block) / _pairs(chunk, 0, None)
            f += (whole - chunks * self_part) / world + chunks * own
    return f


def _gathered_walk_row_bytes(arch: Arch, layer: LayerSpec, b: int, gk: bool) -> float:
    """Bytes per chunk token a divided reverse walk's layer keeps for the whole chunk (its
    rows of every rank, gathered, and the chunk's output that every rank computes):
    attention q/k/v and output; MLA the absorbed queries and latent rows, and the latent
    output (the indexer's gathered inputs take no grad and are freed with the layer); GDN
    its whole replicated conv + recurrence graph."""
    if layer.mixer == "attention":
        return (2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * b
    if layer.mixer == "mla":
        kl, r = arch.kv_lora_rank, arch.rope_dim
        return ((arch.heads + 1) * (kl + r) + arch.heads * kl) * b
    return graph_bytes_per_token(arch, layer, b, gk)


def _divided_working(arch: Arch, mine: int, chunk: int, b: int, acc: int) -> float:
    """No-grad working set of a divided capture layer on a rank holding `mine` positions:
    the hidden shard, its residual and the layer output ([mine, d] each), plus the larger of
    an attention layer's q/k/v/output rows (and the fp32 running output of its queries), an
    MLA layer's (its queries before and after absorption, latent rows, running output, and
    DSA's indexer inputs and running top-k), and a GDN layer's projections (conv input, z, gates) with the per-token read of the start
    state and zero-start output (accumulation dtype); the MLP runs in pieces of `chunk`
    (counted by the chunked no-grad working set)."""
    hidden = 3 * mine * arch.hidden * b
    layers = [0.0]
    if arch.count(mixer="attention"):
        layers.append(mine * ((2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * b
                              + arch.heads * arch.head_dim * acc))
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


def rank_positions_of(positions: int, world: int, block: int, rank: int) -> int:
    """Prompt positions rank `rank` holds (as `state.Shard.count`)."""
    cycle = block * world
    full, rem = divmod(positions, cycle)
    return full * block + min(max(rem - rank * block, 0), block)


def rank_positions(positions: int, world: int, block: int) -> int:
    """Prompt positions the fullest rank holds: blocks of `block` positions dealt
    round-robin, block b on rank b % world (as `state.Shard`)."""
    cycle = block * world
    full, rem = divmod(positions, cycle)
    return full * block + min(rem, block)


def estimate(model, config: PlanConfig) -> dict:
    """Plan one GRPO step of `model` (preset name, config.json path, or config dict).

    Returns a flat dict of figures (bytes, FLOPs, seconds, booleans) plus 'breakdown',
    'inputs' and 'assumptions'. Memory figures named *_per_rank, and param / grad /
    optimizer / working bytes, are what one rank holds.
    """
    name, cfg, preset = load_model_config(model)
    arch = architecture(cfg)
    c = config
    P, R, G, W = c.prompt_tokens, c.response_tokens, c.group, c.gpus
    dtype = c.dtype or arch.dtype or "bfloat16"
    b = DTYPE_BYTES[dtype]  # activations, state, trainable params
    acc = 8 if dtype == "float64" else 4  # attention / softmax accumulation
    rb = max(4, b)  # GDN recurrent state: fp32 (fp64 under fp64)
    wdt = c.weight_dtype or dtype
    params = count_parameters(arch, c.lora_rank, c.lora_targets)
    if wdt in QUANT_BYTES and arch.count(mixer="mla"):
        raise ConfigError(f"weight_dtype {wdt!r}: the engine refuses quantized base weights for MLA models "
                          "(absorbed MLA needs kv_b_proj as a float matrix); plan them in bf16")
    assumptions = []

    # ---- state
    exact = c.mode == "exact"
    st = _state_sizes(arch, b, rb, P, keep_windows=exact)
    p_rank = rank_positions(P, W, c.attention_block_size) if W > 1 else P
    state_total = st["per_token"] * P + st["fixed"]
    state_rank = st["per_token"] * p_rank + st["fixed"]
    # exact mode keeps the GDN snapshot at every chunk end of the WHOLE prompt on every rank
    # (the recurrent state is replicated, and every rank walks every chunk); the last one
    # is the state itself, already in state_rank
    n_chunks = math.ceil(P / c.chunk_size)
    checkpoints = (n_chunks - 1) * (st["recurrent_fixed"] + st["conv_tail_fixed"]) if exact else 0
    # state gradients accumulate in fp32 (fp64 for fp64) whatever the state dtype
    # (and the GDN snapshots' gradients, one per chunk start, kept until the step ends)
    state_grad = (st["per_token"] * p_rank * acc // b
                  + n_chunks * (st["recurrent_fixed"] + st["conv_tail_fixed"] * acc // b) if exact else 0)
    state_gpu, state_host, state_grad_gpu = state_rank, 0, state_grad

    # ---- weights, gradients, optimizer
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
    gathered = 0.0
    if c.shard_params:
        param_bytes, grad_bytes, optimizer_bytes = param_bytes / W, grad_bytes / W, optimizer_bytes / W
        per_layer = base / len(arch.layers)
        gathered = 2 * per_layer
        assumptions.append("shard_params: weights, grads and optimizer state sharded 1/W; two layers' weights "
                           "gathered at a time (counted in the static memory)")
    else:
        assumptions.append("weights, grads and optimizer state replicated on every rank")

    # ---- working sets
    T = min(R, c.branch_chunk_size or R)  # tokens in one replayed piece
    held = (R - 1) // T * T if T < R else 0  # branch tokens held as a state while pieces are walked back
    C = min(c.chunk_size, P)  # capture / recompute chunk: every rank runs every chunk's tokens
    gk = c.gdn_kernel
    graph_tok = sum(graph_bytes_per_token(arch, l, b, gk) for l in arch.layers) + 3 * arch.hidden * b
    dense_grad = c.self_attention != "flash"  # self part of autograd passes (replay, recompute)
    fused_nograd = c.self_attention != "dense"  # capture through a fused kernel
    blk = c.attention_block_size
    # under CP a rank's queries read its own shard of the prompt (plus the branch's held pieces)
    replay_graph, replay_attn = autograd_pass(arch, T, p_rank + held, blk, b, acc, dense_grad, gk)
    logits = min(T, c.logits_chunk_size) * arch.vocab * (b + 3 * 4) + T * arch.hidden * b
    # the earlier pieces' state (and the recurrent state at each piece start), with grad buffers
    branch_state = 2 * (st["per_token"] * held + held // T * (st["recurrent_fixed"] + st["conv_tail_fixed"]))
    replay_working = replay_graph + max(replay_attn, logits) + branch_state

    def nograd_working(tokens: int) -> float:
        """One no-grad pass of `tokens` queries over the rank's prompt: the largest layer."""
        return max(nograd_layer_bytes(arch, l, tokens, p_rank, blk, acc, b, gk, fused=fused_nograd)
                   for l in arch.layers)

    # the engine's rule (Engine.divides_capture): not with kept chunk graphs or an
    # offloaded state, and only when every rank owns a block
    divided = (c.divide_capture and W > 1 and not c.offload_state
               and not (c.mode == "exact" and c.keep_graph_bytes > 0)
               and P - 1 > (W - 1) * c.attention_block_size)
    capture_working = nograd_working(C)
    capture_comm = 0.0
    if divided:  # layer by layer over the rank's positions: its hidden shard and one layer's projections
        capture_working = max(capture_working, _divided_working(arch, p_rank, C, b, acc))
        capture_comm = divided_capture_traffic(cfg, positions=P - 1, world=W, block=c.attention_block_size,
                                               chunk_size=c.chunk_size, dtype=dtype, exact=exact)
    recompute_working = sum(autograd_pass(arch, C, p_rank, blk, b, acc, dense_grad, gk)) if exact else 0.0
    # exact mode's kept capture graphs (the last chunks that fit), alive from capture to their walk
    chunks = -(-max(P - 1, 1) // C)
    chunk_graph = autograd_pass(arch, C, p_rank, blk, b, acc, dense_grad, gk)[0]
    kept_chunks = min(chunks, int(c.keep_graph_bytes // chunk_graph)) if exact and c.keep_graph_bytes else 0
    kept_bytes = kept_chunks * chunk_graph
    # the engine's rule (Engine.divides_walk): no kept chunk graphs, no offloaded state, a block
    # for every rank (sharded weights: FSDP2 over the W ranks, whose reduce-scatter then sums)
    divided_walk = (exact and c.divide_walk and W > 1 and not c.offload_state
                    and kept_chunks == 0 and P - 1 > (W - 1) * c.attention_block_size)
    walk_chunk, walk_comm = C, 0.0
    if divided_walk:  # the rank's own tokens of one walk chunk with autograd, plus the chunk's gathered q/k/v
        # and output rows per attention layer and its replicated attention (self part, blockwise backward),
        # and per GDN layer its replicated conv + recurrence (bounded by the layer's whole graph per token)
        walk_chunk = walk_chunk_tokens(P - 1, c.chunk_size, W, c.attention_block_size, bool(arch.count(mixer="gdn")))
        own = rank_positions(walk_chunk, W, c.attention_block_size)
        gathered_rows = walk_chunk * sum(_gathered_walk_row_bytes(arch, layer, b, gk) for layer in arch.layers)
        whole, attn = autograd_pass(arch, walk_chunk, p_rank, blk, b, acc, dense_grad, gk)
        self_part = whole - walk_chunk * graph_tok  # the dense self part's scores, when counted
        recompute_working = (autograd_pass(arch, own, p_rank, blk, b, acc, False, gk)[0] + gathered_rows
                             + self_part + attn)
        # the replicated parameters' gradients summed after the walk: LoRA's, or (FSDP2 reduce-scatters
        # the sharded layers itself) the embeddings and lm_head, or every parameter
        grad_elems = (params.lora if c.lora_rank else params.embedding + params.lm_head if c.shard_params
                      else params.total - indexer_parameters(arch))
        walk_comm = divided_walk_traffic(cfg, positions=P - 1, world=W, block=c.attention_block_size,
                                         chunk_size=c.chunk_size, dtype=dtype, grad_bytes=grad_elems * b)
    score_working = 0.0
    if c.score_passes:  # one whole branch without autograd; fp32 logits + log-softmax of one chunk
        score_working = nograd_working(R) + min(R, c.logits_chunk_size) * arch.vocab * (b + 2 * 4)
    offload = None
    if c.offload_state:  # per-token rows (and their gradients) in host memory, two layers' slots on the device
        pieces = -(-R // T)
        offload = offload_plan(arch, b=b, acc=acc, exact=exact, prompt=P, chunk=c.chunk_size, world=W,
                               block=c.attention_block_size, group=G, pieces=pieces, held_pieces=held // T,
                               score_passes=c.score_passes)
        state_host = offload["host_bytes"]
        state_gpu = st["fixed"] + offload["slot_bytes"]
        state_grad_gpu = (n_chunks * (st["recurrent_fixed"] + st["conv_tail_fixed"] * acc // b)) if exact else 0
        assumptions.append(
            f"offload: {offload['staged_layers']} layers' per-token rows (+ exact mode's gradient rows) in host "
            "memory; on the device two slots of the largest layer's rows (+ its gradient rows) and the constant "
            "state; every pass stages each layer it visits once (traffic and its time at "
            f"{c.host_bandwidth_gbs:g} GB/s host link; copies overlap compute, so the step takes at least the "
            "larger of the two)")
    static = param_bytes + grad_bytes + optimizer_bytes + gathered + state_gpu + state_grad_gpu + checkpoints
    # what each phase holds beyond the static memory (capture may run before any gradient exists)
    phases = {"capture": capture_working + kept_bytes - (0 if c.grads_during_capture else grad_bytes),
              "replay": replay_working + kept_bytes}
    if exact:  # the walk frees the kept graphs first; a chunk is recomputed only after all of them
        phases["recompute"] = max(kept_bytes + (recompute_working - chunk_graph if kept_chunks else 0),
                                  recompute_working if kept_chunks < chunks else 0)
    if c.score_passes:
        phases["score"] = score_working
    peak_phase = max(phases, key=phases.get)
    peak = static + phases[peak_phase]
    fits = peak + c.reserve <= c.gpu_memory

    # ---- time
    thr = c.throughput_tflops * 1e12
    flops_prompt = _forward_flops(arch, params, P, 0, lm_head=False, world=W)  # one replicated prompt forward
    flops_capture = divided_flops(arch, params, P, W, c.attention_block_size) if divided else flops_prompt
    branch_fwd = _forward_flops(arch, params, R, P, lm_head=True, world=W)
    held_fwd = _forward_flops(arch, params, held, P, lm_head=False, world=W) if held else 0.0
    flops_branch = (1 + BACKWARD_FACTOR + c.score_passes) * branch_fwd + held_fwd
    # exact: a backward of every chunk, and a recomputed forward of those not kept; replicated,
    # every rank recomputes and backpropagates every chunk; divided, its own tokens of each
    if divided_walk:
        flops_exact_extra = (BACKWARD_FACTOR + 1) * divided_walk_flops(arch, params, P, W, c.attention_block_size,
                                                                       walk_chunk)
    else:
        flops_exact_extra = (BACKWARD_FACTOR + (chunks - kept_chunks) / chunks) * flops_prompt
    t_detached = (flops_capture + G * flops_branch) / thr  # FLOPs of one rank (see _forward_flops)
    t_exact = t_detached + flops_exact_extra / thr
    t_transfer = offload["traffic_bytes"] / (c.host_bandwidth_gbs * 1e9) if offload else 0.0

    assumptions += [
        f"state counted for all P = {P:,} prompt positions (capture keeps P - 1); per-token state sharded in "
        f"blocks of {c.attention_block_size} dealt round-robin: {p_rank:,} positions on the fullest rank; constant "
        "(recurrent / window) state replicated" + ("; exact mode keeps every sliding-window position and one GDN "
                                                   "snapshot per chunk of the whole prompt on every rank"
                                                   if exact else ""),
        f"state in {dtype}; GDN recurrent state in {'fp64' if rb == 8 else 'fp32'}"
        + ("; state gradients in fp32" if exact and acc == 4 else ""),
        "replay working = one piece's autograd graph (T tokens x activation bytes per token, all layers) "
        "+ the larger of the blockwise-attention and chunked-logits working sets",
        "self-attention of a piece / chunk: " + {
            "dense": "plain torch everywhere ([heads, T, T] fp32 scores + probs per attention layer; today's code "
                     "on CUDA)",
            "fused-nograd": "a fused kernel without autograd (capture), plain torch with autograd (today's code "
                            "on CPU)",
            "flash": "a fused kernel everywhere (O(T) kept)"}[c.self_attention],
        f"FLOPs: 2 x active matmul params x tokens + attention QK/PV; backward = {BACKWARD_FACTOR:g} x forward; "
        "capture x1, replay x(1 + backward) per branch (+ x1 per score pass; pieces add a no-grad forward of the "
        "held tokens), exact adds a backward of the prompt forward plus a recomputed forward of every chunk whose "
        "graph is not kept",
        f"time = one rank's FLOPs / {c.throughput_tflops:g} TFLOP/s effective (communication not counted): "
        + ("capture divided (each prompt token on one rank; GDN transitions (Dk+Dv)/Dv of a plain pass), "
           if divided else "capture replicated except attention over the prompt state (divided by W), ")
        + (f"the exact reverse walk divided (each prompt token on one rank; each walk chunk's own causal attention, "
           f"{walk_chunk:,} tokens, and GDN conv + recurrence on every rank), " if divided_walk else
           "the exact reverse walk replicated except attention over the prompt state (divided by W), "
           if exact else "")
        + "replay replicated except attention over the prompt state (divided by W)",
        f"GDN kernel: {gk} " + ("(ops/gated_delta.py, fp32 arithmetic)" if gk == "torch" else
                                "(flash-linear-attention; working set estimated, not measured)"),
        "capture " + ("counted with the parameter gradients allocated (any group after the first of a batch)"
                      if c.grads_during_capture else
                      "counted before any parameter gradient exists (first group after zero_grad(set_to_none))"),
        f"fits = peak + reserve ({human_bytes(c.reserve)}) <= gpu_memory",
    ]
    published = preset.get("num_parameters")
    report = {
        "model": name,
        "model_type": arch.model_type,
        "mode": c.mode,
        "dtype": dtype,
        "weight_dtype": wdt,
        "num_layers": len(arch.layers),
        "layer_counts": {k: v for k, v in {
            "full_attention": arch.count(mixer="attention", window=None),
            "sliding_attention": sum(l.mixer == "attention" and l.window is not None for l in arch.layers),
            "gated_deltanet": arch.count(mixer="gdn"),
            "mla": arch.count(mixer="mla"),
            "dsa_indexer": arch.count(indexer=True),
            "moe": arch.count(mlp="moe")}.items() if v},
        "num_parameters": params.total,
        "num_active_parameters": params.active,
        "num_parameters_published": published,
        "trainable_parameters": trainable,
        "lora_parameters": params.lora,
        "state_bytes_per_token": st["per_token"],
        "state_bytes_fixed": st["fixed"],
        "state_bytes_total": state_total,
        "state_bytes_per_rank": state_rank,
        "state_bytes_on_gpu_per_rank": state_gpu,
        "state_bytes_host_per_rank": state_host,
        "state_grad_bytes_per_rank": state_grad,
        "exact_checkpoint_bytes_per_rank": checkpoints,
        "param_bytes": int(param_bytes),
        "grad_bytes": int(grad_bytes),
        "optimizer_bytes": int(optimizer_bytes),
        "gathered_param_bytes": int(gathered),
        "replay_working_bytes": int(replay_working),
        "capture_working_bytes": int(capture_working),
        "recompute_working_bytes": int(recompute_working),
        "chunk_graph_bytes": int(chunk_graph) if exact else 0,
        "kept_graph_chunks": kept_chunks,
        "kept_graph_bytes": int(kept_bytes),
        "recomputed_chunks": chunks - kept_chunks if exact else 0,
        "score_working_bytes": int(score_working),
        "static_bytes_per_rank": int(static),
        "peak_bytes_per_rank": int(peak),
        "peak_phase": peak_phase,
        "gpu_memory_bytes": c.gpu_memory,
        "reserve_bytes": c.reserve,
        "fits": bool(fits),
        "divided_capture": bool(divided),
        "divided_walk": bool(divided_walk),
        "walk_chunk_tokens": walk_chunk if exact else 0,
        "capture_comm_bytes_per_rank": capture_comm,
        "walk_comm_bytes_per_rank": walk_comm,
        "flops_capture": flops_capture,
        "flops_replay_per_branch": flops_branch,
        "flops_exact_extra": flops_exact_extra,
        "estimated_time_s_detached": t_detached,
        "estimated_time_s_exact": t_exact,
        "estimated_time_s": max(t_exact if exact else t_detached, t_transfer),
        "offload_host_bytes_per_rank": state_host,
        "offload_slot_bytes_per_rank": offload["slot_bytes"] if offload else 0,
        "offload_traffic_bytes_per_step": offload["traffic_bytes"] if offload else 0,
        "offload_transfer_time_s": t_transfer,
        "offload_decode_bytes_per_token": offload["decode_bytes_per_token"] if offload else 0,
        "breakdown": {
            "state": {k: v for k, v in st.items() if k not in ("per_token", "fixed")},
            "replay": {"piece_tokens": T, "held_branch_tokens": held, "graph_bytes_per_token": graph_tok,
                       "graph_bytes": replay_graph, "attention_working_bytes": replay_attn,
                       "logits_working_bytes": logits, "branch_state_bytes": branch_state},
            "capture": {"chunk_tokens": C, "working_bytes": capture_working},
            "phase_peak_bytes": {k: int(static + v) for k, v in phases.items()},
            "time_s": {"capture": flops_capture / thr, "replay_per_branch": flops_branch / thr,
                       "exact_extra": flops_exact_extra / thr},
        },
        "offload": offload,
        "inputs": {**asdict(c), "dtype": dtype, "weight_dtype": wdt},
        "assumptions": assumptions,
    }
    return report


# ----------------------------------------------------------------------------
# text report


def format_report(r: dict) -> str:
    """The human-readable table of an `estimate` result."""
    i = r["inputs"]
    hb = human_bytes
    rows = [
        ("model", f"{r['model']} ({r['model_type']}, {r['num_layers']} layers: "
                  + ", ".join(f"{v} {k}" for k, v in r["layer_counts"].items()) + ")"),
        ("parameters", f"{r['num_parameters'] / 1e9:,.3f}B counted ({r['num_active_parameters'] / 1e9:,.3f}B active)"
         + (f"; published {r['num_parameters_published'] / 1e9:,.3f}B" if r["num_parameters_published"] else "")),
        ("trainable", f"{r['trainable_parameters']:,}" + (" (LoRA)" if i["lora_rank"] else " (full)")),
        ("step", f"P={i['prompt_tokens']:,}  G={i['group']}  R={i['response_tokens']:,}  mode={r['mode']}  "
                 f"W={i['gpus']}  dtype={r['dtype']}  weights={r['weight_dtype']}"),
        None,
        ("state per prompt token", f"{r['state_bytes_per_token']:,} B"),
        ("state, constant in P", hb(r["state_bytes_fixed"])),
        ("state, whole prompt", hb(r["state_bytes_total"])),
        ("state per rank", hb(r["state_bytes_per_rank"])),
    ]
    if i["offload_state"]:
        o = r["offload"]
        rows += [
            ("offload: host memory per rank", hb(r["offload_host_bytes_per_rank"]) + " (per-token rows"
             + (" + their fp32 gradients)" if r["mode"] == "exact" else ")")),
            ("offload: device slots", hb(r["offload_slot_bytes_per_rank"]) + " (2 layers' rows"
             + (" + gradients)" if r["mode"] == "exact" else ")")),
            ("offload: traffic per step", hb(r["offload_traffic_bytes_per_step"])
             + f" = {r['offload_transfer_time_s']:,.1f} s at {i['host_bandwidth_gbs']:g} GB/s  (H2D "
             + ", ".join(f"{k} {hb(v).split(' (')[0]}" for k, v in o["h2d_bytes"].items()) + "; D2H "
             + ", ".join(f"{k} {hb(v).split(' (')[0]}" for k, v in o["d2h_bytes"].items()) + ")"),
            ("offload: decode traffic per token", hb(r["offload_decode_bytes_per_token"])),
        ]
    rows += [
        None,
        ("weights per rank", hb(r["param_bytes"])),
        ("gradients per rank", hb(r["grad_bytes"])),
        ("optimizer per rank", hb(r["optimizer_bytes"])),
    ]
    if r["mode"] == "exact":
        rows += [("state gradient per rank", hb(r["state_grad_bytes_per_rank"])
                  + (" (its per-token part in host memory)" if i["offload_state"] else "")),
                 ("recurrent checkpoints per rank", hb(r["exact_checkpoint_bytes_per_rank"]))]
    rows += [
        ("working: capture (divided, layer by layer)" if r["divided_capture"] else "working: capture (1 chunk)",
         hb(r["capture_working_bytes"])),
        ("working: replay (1 branch)", hb(r["replay_working_bytes"])),
    ]
    if r["mode"] == "exact":
        rows.append(("working: recompute (1 chunk" + (", divided)" if r["divided_walk"] else ")"),
                     hb(r["recompute_working_bytes"])))
        if r["kept_graph_chunks"]:
            rows.append((f"kept capture graphs ({r['kept_graph_chunks']} of "
                         f"{r['kept_graph_chunks'] + r['recomputed_chunks']} chunks)", hb(r["kept_graph_bytes"])))
    rows += [
        ("static per rank", hb(r["static_bytes_per_rank"])),
        ("PEAK per rank", f"{hb(r['peak_bytes_per_rank'])}  (during {r['peak_phase']})"),
        ("  each phase", ", ".join(f"{k} {hb(v).split(' (')[0]}" for k, v in r["breakdown"]["phase_peak_bytes"].items())
         + ("" if i["grads_during_capture"] else "  (capture before any gradient exists)")),
        ("fits", f"{'yes' if r['fits'] else 'NO'}  (peak + {hb(r['reserve_bytes'])} reserve vs "
                 f"{hb(r['gpu_memory_bytes'])})"),
        None,
        ("capture traffic per rank", hb(r["capture_comm_bytes_per_rank"])),
        ("exact walk traffic per rank", hb(r["walk_comm_bytes_per_rank"]) if r["divided_walk"] else
         "not modelled (no divided walk)"),
        ("time, detached", f"{r['estimated_time_s_detached']:,.1f} s"),
        ("time, exact", f"{r['estimated_time_s_exact']:,.1f} s"),
        ("  at", f"{i['throughput_tflops']:g} TFLOP/s effective per rank x {i['gpus']} rank(s)"),
    ]
    if i["offload_state"]:
        rows.append(("time, with offload", f"{r['estimated_time_s']:,.1f} s  (the larger of compute and "
                                           f"{r['offload_transfer_time_s']:,.1f} s of transfer, overlapped)"))
    width = max(len(row[0]) for row in rows if row)
    lines = [f"  {row[0]:<{width}}  {row[1]}" if row else "" for row in rows]
    lines += ["", "  assumptions:"] + [f"    - {a}" for a in r["assumptions"]]
    return "\n".join(lines)
