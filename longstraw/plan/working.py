"""Capacity planner, working sets: the bytes LongStraw's passes hold beyond the weights
and the prompt state, per layer kind and kernel. `estimate.py` combines them into the
peak of each phase (capture, replay, recompute, score).

Two kinds of figure:
  * graph bytes: what one token leaves in the autograd graph of one layer (kept until
    the backward of the piece / chunk);
  * transient bytes: what one layer's kernel holds for a moment (no-grad capture, a
    blockwise attention's backward, the DSA top-k selection); only the largest counts.

Each formula follows the code it models (named in its docstring); the constants that
mirror kernel defaults live in `arch.py`. Shapes: T queries (tokens of a chunk or a
replayed piece), N keys (held prompt positions), H heads, acc = the accumulation dtype's
bytes (fp32, fp64 under fp64), b = the compute dtype's bytes.
"""

from __future__ import annotations

from .arch import (
    GDN_CHUNK,
    INDEXER_KEY_BLOCK,
    INDEXER_QUERY_BLOCK,
    SPARSE_QUERY_BLOCK,
    TOPK_SELECT_BYTES,
    RECURRENT_PARAMS,
    Arch,
    LayerSpec,
    layer_linears,
)
from .experts import local_choices, moe_backward_bytes_per_token
from ..defaults import FLASH_BACKWARD_BLOCK


def gdn_kernel_bytes_per_token(arch: Arch, b: int, kernel: str, *, graph: bool) -> float:
    """Bytes per token inside the chunked gated-delta kernel of one GDN layer.

    'torch' (ops/gated_delta.py, arithmetic in acc = max(4, b) bytes), elements per token:
    q/k expanded to the value heads and chunked, k*beta, W_k, the state reads / writes
    (8 x Hv x Dk); v chunked and W_v (2 x Hv x Dv); then the larger of two moments: the
    three [Hv, C, C] matrices per chunk (pair decay, the system, the intra-chunk scores)
    plus one temporary (4 x Hv x C), or the chunk outputs and their concatenation
    (2 x Hv x Dv) with the three matrices. The torch kernels are registered ops
    (`ops/registered.py`) whose autograd keeps only their inputs: `graph=True` is 0, and
    their backward recomputes the kernel under autograd (`torch_kernel_graph_bytes_per_token`,
    counted by `recurrent_backward_bytes_per_token`).
    Check: tiny qwen3_5, one detached step at P = 4,096 in one chunk: planner 87.3 MB,
    live tensors 88.4 MB.
    'fla' (flash-linear-attention, bf16/fp16 on CUDA): q/k expanded, v, out, w, u in b,
    the [T, Hv, C] fp32 intra-chunk matrix and one fp32 state per chunk (not measured here).
    """
    hv, dk, dv, c = arch.gdn_v_heads, arch.gdn_k_dim, arch.gdn_v_dim, GDN_CHUNK
    states = hv * dk * dv * 4 / c
    if kernel == "torch" and graph:
        return 0.0
    if kernel == "torch" and arch.recurrent != "gdn":
        return recurrent_kernel_bytes_per_token(arch, b, "nograd")
    if kernel == "torch":
        acc = max(4, b)
        return (8 * hv * dk + 2 * hv * dv + max(4 * hv * c, 2 * hv * dv + 3 * hv * c)) * acc
    return (4 * hv * dk + 3 * hv * dv) * b + hv * c * 4 + states


def torch_kernel_graph_bytes_per_token(arch: Arch, b: int) -> float:
    """What plain torch autograd keeps per token through one torch GDN / KDA / SSD kernel:
    the graph the registered op's backward rebuilds when it recomputes the kernel.

    GDN: q/k/v, k*beta, both solves' inputs and outputs, the read / write terms, the chunk
    values and the matrices (~8 x Hv x Dk + 4 x Hv x Dv + 4 x Hv x C elements in acc),
    plus one [Hv, Dk, Dv] state per chunk. KDA / SSD: `recurrent_kernel_bytes_per_token`'s
    fitted "graph"."""
    if arch.recurrent != "gdn":
        return recurrent_kernel_bytes_per_token(arch, b, "graph")
    hv, dk, dv, c = arch.gdn_v_heads, arch.gdn_k_dim, arch.gdn_v_dim, GDN_CHUNK
    return (8 * hv * dk + 4 * hv * dv + 4 * hv * c) * max(4, b) + hv * dk * dv * 4 / c


def recurrent_kernel_bytes_per_token(arch: Arch, b: int, moment: str) -> float:
    """Bytes per token inside the torch KDA (`ops/kda.chunk_kda`) or SSD (`ops/ssd.chunk_ssd_scan`)
    kernel of one layer, in acc = max(4, b) bytes, at `moment`: "nograd" (its peak without
    autograd), "graph" (what its autograd graph keeps), "backward" (its backward's peak
    above that graph). Chunks of C = 64 tokens.

    KDA (H heads, Dk, Dv): its per-channel decay makes every pair (i, j) of a chunk a Dk
    vector, [H, C, C, Dk] per chunk, so C x Dk elements per token and head: the pair decay
    and the two three-operand einsums' intermediates (3 of them) dominate all moments.
    SSD (H heads, P head dim, N d_state): B and C expanded to the heads and chunked (the
    N terms), x dt and its chunks, the [H, C, C] pair decay and scores, one [H, P, N]
    written state per chunk.

    Fitted on live-tensor peaks of the kernels alone (T = 1,024, fp32; KDA: H 2-4, Dk
    32-64, Dv 32-64, C 32-64; SSD: H 8-16, P 32-64, N 64-128, C 32-64; every point
    within 5%), elements per token:
        KDA   nograd H (3 C Dk + 6 Dk)   graph H (3 C Dk + 11 Dk + 3 Dv)   backward H (3 C Dk - 4 Dk)
        SSD   nograd H (3P + 5N + C + PN/C)   graph H (2P + 6N + 3C + PN/C)   backward H (N + C + 2PN/C)
    """
    h, c, acc = arch.gdn_v_heads, GDN_CHUNK, max(4, b)
    if arch.recurrent == "kda":
        dk, dv = arch.gdn_k_dim, arch.gdn_v_dim
        e = {"nograd": 3 * c * dk + 6 * dk, "graph": 3 * c * dk + 11 * dk + 3 * dv, "backward": 3 * c * dk - 4 * dk}
    else:  # mamba2: gdn_v_dim = P, gdn_k_dim = N
        p, n = arch.gdn_v_dim, arch.gdn_k_dim
        e = {"nograd": 3 * p + 5 * n + c + p * n / c, "graph": 2 * p + 6 * n + 3 * c + p * n / c,
             "backward": n + c + 2 * p * n / c}
    return h * e[moment] * acc


def recurrent_backward_bytes_per_token(arch: Arch, layer: LayerSpec, b: int, gdn_kernel: str) -> float:
    """The torch GDN / KDA / SSD kernel's backward peak above the layer's graph, per token:
    the registered op's backward recomputes the kernel under autograd (its whole graph,
    `torch_kernel_graph_bytes_per_token`) and differentiates it (KDA / SSD: the fitted
    "backward" moment above that graph; GDN: not measured, 0). 0 for other layers and for
    the fla kernels, whose backward is not modelled."""
    if layer.mixer != "gdn" or gdn_kernel != "torch":
        return 0.0
    above = 0.0 if arch.recurrent == "gdn" else recurrent_kernel_bytes_per_token(arch, b, "backward")
    return torch_kernel_graph_bytes_per_token(arch, b) + above


FP32_NORM_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
"""Model types whose RMSNorm multiplies by its weight in float32 (`output * (1 + weight.float())`,
then `type_as(x)`), so in half precision it keeps two float32 copies of its input's width."""


def norm_bytes_per_token(arch: Arch, width: int, ab: int) -> float:
    """Bytes one token leaves in the autograd graph of an HF RMSNorm of `width`: 3 x width
    x ab in float32 (input, intermediate, output; calibrated on tiny-qwen3). In half
    precision the norm computes in float32, so its `x.float()` copy (kept by `pow` and the
    product) is 4 bytes an element: Qwen3.5's norm keeps that, its float32 normalized
    input (kept by the weight product) and the half-precision output (8 + ab bytes an
    element); a Llama-style norm (`weight * x.to(dtype)`) the float32 copy and two half
    copies (4 + 2 ab). Found by rehearsing Qwen3.6-27B in bf16 (`ls.rehearse`): at the
    replay peak each norm held [2048, 5120] float32 twice and bf16 once (the Llama-style
    count follows HF's code, not measured)."""
    if ab >= 4:
        return 3 * width * ab
    return (8 + ab) * width if arch.model_type in FP32_NORM_FAMILIES else (4 + 2 * ab) * width


def gated_norm_bytes_per_token(arch: Arch, ab: int) -> float:
    """Bytes one token leaves in the autograd graph of a GDN layer's gated norm
    (`Qwen3_5RMSNormGated`) over its Hv x Dv output: 2 x ab an element in float32 (as
    calibrated on tiny qwen3_5); in half precision its float32 copies of the input, of
    the gate and of silu(gate) and three half copies (normalized, weighted, output):
    3 x 4 + 3 x ab. Found by rehearsing Qwen3.6-27B in bf16: [2048 x 48, 128] float32
    three times and bf16 three times per GDN layer at the replay peak."""
    width = arch.gdn_v_heads * arch.gdn_v_dim
    return 2 * width * ab if ab >= 4 else (12 + 3 * ab) * width


def graph_bytes_per_token(arch: Arch, layer: LayerSpec, ab: int, gdn_kernel: str) -> float:
    """Activation bytes one token leaves in the autograd graph of one layer.

    Element counts (each x ab bytes): two RMSNorms (`norm_bytes_per_token`: in float32
    ~3 x the width each: input, fp32 intermediate, output; more in half precision);
    projections keep their outputs; SwiGLU keeps gate, up, act and act*up (4 x width).
    Calibrated on tiny-qwen3 against HF's saved tensors (5,376 vs 5,388 elements per
    token per layer, fp32). A GDN layer adds its gated norm (`gated_norm_bytes_per_token`)
    and its kernel's graph (`gdn_kernel_bytes_per_token`).
    """
    h, H = arch.hidden, arch.heads
    e = 0
    extra = 2 * norm_bytes_per_token(arch, h, ab)
    if layer.mixer == "attention":
        qk_copies = 3 if arch.qk_norm else 2  # projection, (norm), rope
        e += qk_copies * (H + arch.kv_heads) * arch.head_dim + arch.kv_heads * arch.head_dim + H * arch.head_dim
        e += 3 * H * arch.head_dim if arch.attn_gate else 0  # gate half, sigmoid, gated product
    elif layer.mixer == "gdn":
        # projections + conv in/out/act, gated norm, decay / beta
        e += 4 * arch.conv_dim + 4 * arch.gdn_v_heads
        extra += gated_norm_bytes_per_token(arch, ab) + gdn_kernel_bytes_per_token(arch, ab, gdn_kernel, graph=True)
    else:  # absorbed MLA: q latent per head, latent output per head
        H, kl, r = arch.heads, arch.kv_lora_rank, arch.rope_dim
        e += 4 * (arch.q_lora_rank or 0) + H * (arch.nope_dim + r) + H * (kl + r) + 4 * (kl + r) + H * kl
        e += H * arch.v_head_dim
    return (e * ab + extra + mlp_graph_bytes_per_token(arch, layer, ab) + context_parallel_bytes_per_token(arch, layer, ab)
            - lora_graph_saving(arch, layer, ab))


def lora_graph_saving(arch: Arch, layer: LayerSpec, ab: int) -> float:
    """Bytes per token one layer's autograd graph keeps less under LoRA (`arch.lora`) than
    in full training (autograd saves a tensor only for an input that needs a gradient):
    a frozen norm keeps no normalized input for its weight's gradient (the layer's two
    norms and an attention layer's q / k norms: 4 bytes an element in float32 and for
    Qwen3.5's float32 product, ab for a Llama-style `weight * x.to(dtype)`); a frozen
    linear that is not adapted keeps no input: the MLP's (or shared expert's) down_proj
    under "attention" targets; each adapted linear keeps its adapter's [r] output.
    Not counted (kept as in full training): the GDN gated norm, MLA's inner norms, the
    routed experts. Measured (tiny qwen3, fp32, every capture graph kept, P = 2,048):
    1,402 elements a token and layer less with LoRA 16 on attention (this: 1,408), 581
    on all-linear (592); found by rehearsing LoRA (`ls.rehearse(..., lora_rank=16)`)."""
    if arch.lora is None:
        return 0.0
    rank, targets = arch.lora
    norm = 4 if ab >= 4 or arch.model_type in FP32_NORM_FAMILIES else ab
    widths = arch.hidden * ((0 if layer.parallel else 1) + (layer.mlp != "none"))
    if layer.mixer == "attention" and arch.qk_norm:
        widths += (arch.heads + arch.kv_heads) * arch.head_dim
    saved = widths * norm
    if targets == "attention":
        saved += (arch.intermediate if layer.mlp == "dense" else arch.shared_intermediate if layer.mlp == "moe"
                  else 0) * ab
    groups = layer_linears(arch, layer)
    recurrent = layer.mixer == "gdn" and arch.recurrent != "gdn"
    adapted = len(RECURRENT_PARAMS["adapted"](arch) if recurrent else groups["mixer"])
    adapted += len(groups["mlp"]) if targets == "all-linear" else 0
    return saved - adapted * rank * ab


def context_parallel_bytes_per_token(arch: Arch, layer: LayerSpec, ab: int) -> float:
    """What context parallelism adds to `graph_bytes_per_token` of an attention or MLA
    layer (`arch.context_ranks` > 1), in the accumulation dtype per token. Attention
    (`ops/attention.py`): the prompt shard's partial is merged across ranks
    (`collectives.MergeAcrossRanks`), whose merged [H, Dv] the graph keeps; the prompt
    and self parts are merged in one process too. MLA (`models/mla._sparse_attention`):
    one process attends in one call; under CP the shard and the replicated rows take two,
    merged across ranks and then with each other (`ops.flash.merge_partials`), so the
    second call's output, the merged partial and the sum are kept, each [H, kv_lora_rank]
    (the absorbed value), and a sparse (DSA) layer's two [K] int64 selections of that
    split (the shard's local rows, the rest).
    Found with `bench/live_attribution.py` on tiny glm_moe_dsa at W = 2 (P = 512, R = 1,024
    in one piece, fp32): 27.8 MB more live at the peak than one process, 29.4 MB modelled."""
    if arch.context_ranks <= 1 or layer.mixer not in ("attention", "mla"):
        return 0.0
    acc = max(4, ab)
    if layer.mixer == "attention":  # one process merges prompt and self parts too: only the merged partial is new
        return arch.heads * arch.head_dim * acc
    return 3 * arch.heads * arch.kv_lora_rank * acc + (2 * arch.index_topk * 8 if layer.sparse else 0)


def mlp_graph_bytes_per_token(arch: Arch, layer: LayerSpec, ab: int) -> float:
    """The MLP's share of `graph_bytes_per_token`: SwiGLU's gate, up, act and act*up
    (4 x width); MoE: router scores, each token's k expert rows, the shared expert; none: 0."""
    if layer.mlp == "dense":
        return 4 * arch.intermediate * ab
    if layer.mlp == "moe":  # expert parallelism: HF's forward keeps k rows (`local_choices`), + the combined output
        k, combined = local_choices(arch), (arch.hidden if arch.expert_ranks > 1 else 0)
        return (2 * arch.experts + k * (4 * arch.moe_intermediate + 2 * arch.hidden) + combined
                + 4 * arch.shared_intermediate) * ab
    return 0.0  # mlp "none": a Nemotron-H mixer block, Falcon-H1's attention half


def dsa_selection_bytes(arch: Arch, queries: int, keys: int, b: int, acc: int) -> float:
    """Transient bytes of the DSA indexer's exact top-k (ops/dsa.indexer_topk) for
    `queries` new tokens over `keys` held positions: a [query block, N] score block and
    its selection masks, the [query block, index heads, key block] per-head scores, and,
    under a half dtype, the held indexer keys of one layer upcast to fp32. Check (with the
    [T, K] int64 selection that `attention_working` adds): `indexer_topk` of 4,096 queries
    over 65,536 positions (tiny glm_moe_dsa shapes) holds 130.8 MB of live tensors at its
    peak; planner 130.0 MB. Under context parallelism (`keys` the rank's) the selection
    across ranks scores up to `defaults.select_query_block` queries at once; it is still
    counted at 128: rehearsed and measured live, that larger block (at most 2^26 scores)
    set no phase's peak (GLM-5.2 at 2.1M on 32 ranks; tiny glm_moe_dsa on gloo, where
    counting it planned 1.24x the live peak), so counting it on top of the peak would not
    be the peak either."""
    qb, n = min(queries, INDEXER_QUERY_BLOCK), keys + queries
    w = TOPK_SELECT_BYTES * qb * n + qb * arch.index_heads * min(INDEXER_KEY_BLOCK, n) * acc
    return w + (keys * arch.index_dim * 4 if b < 4 else 0)


def attention_working(arch: Arch, layer: LayerSpec, queries: int, keys: int, block: int, acc: int, *,
                      backward: bool, fused: bool = False, b: int = 4) -> float:
    """Transient bytes of the attention of `queries` rows over `keys` held positions in
    one layer.

    Softmax attention (ops/attention.py): one [H, T, block] tile in acc (the scores turn
    into probabilities in place; backward adds dP, turned into dS in place), the upcast K/V
    block, and q / out / dq rows in acc; `fused` (a flash kernel): only the q / out / lse
    rows.
    MLA with DSA (ops/dsa.py): the larger of the indexer's top-k selection and the gathered
    sparse attention (a [64, K, D] key and value block, its [64, H, K] scores), plus the
    latent q / out rows [H, T, 2 x kv_lora + rope] and the selected positions [T, K]
    (int64): twice in an indexer layer of a model whose other DSA layers reuse the
    selection (GLM-5), since HF's layer loop holds the previous one meanwhile. Dense MLA,
    and a DSA layer whose queries see no more than top-k positions (`models/mla._mla_chunk`
    then attends densely and runs no indexer): as softmax attention over the latent.
    Under context parallelism `keys` are the rank's: the positions seen are taken as
    `keys` x ranks + `queries` (at least the engine's, so a step it runs densely may be
    planned sparse, never the reverse).
    """
    if layer.mixer == "gdn" or keys == 0:
        return 0.0
    if layer.mixer == "attention":
        d = 2 * arch.head_dim
        rows = 3 * arch.heads * queries * d / 2 * acc
        if fused:
            return rows
        B = min(block, keys, layer.window or keys)
        tiles = 2 if backward else 1
        blockwise = tiles * arch.heads * queries * B * acc + arch.kv_heads * B * d * acc + rows
        if backward and layer.window is None:  # where the fused kernel runs instead: whichever is larger
            return max(blockwise, flash_backward_bytes(arch, queries, keys, b) + rows)
        return blockwise
    tiles = 4 if backward else 2
    kl, r = arch.kv_lora_rank, arch.rope_dim
    rows = arch.heads * queries * (2 * kl + r) * acc
    if not layer.sparse or arch.index_topk >= keys * max(arch.context_ranks, 1) + queries:
        B = min(block, keys)
        return rows if fused else tiles * arch.heads * queries * B * acc + B * (kl + r) * acc + rows
    K = min(arch.index_topk, keys + queries)
    qb = min(queries, SPARSE_QUERY_BLOCK)
    gathered = qb * K * (2 * kl + r) * acc * (2 if backward else 1) + tiles * qb * arch.heads * K * acc
    selection = dsa_selection_bytes(arch, queries, keys, b, acc) if layer.indexer else 0.0
    shared = layer.indexer and any(l.sparse and not l.indexer for l in arch.layers)
    return max(selection, gathered) + queries * K * 8 * (2 if shared else 1) + rows


def flash_backward_bytes(arch: Arch, queries: int, keys: int, b: int) -> float:
    """Transient bytes of the fused attention backward over `keys` held positions
    (`ops.flash.FlashAttention`, which runs where torch's flash kernel takes the dtype and
    head dim: CPU fp32 / bf16, CUDA bf16 / fp16): per call of `FLASH_BACKWARD_BLOCK`
    positions, the block's contiguous K and V copies and their dK, dV ([Hkv, block, D] each,
    in b), and the queries' dq of the block ([H, T, D]). Found on tiny qwen3_5 (P = 16,384,
    pieces of 256): 24 MiB of live tensors at the replay peak that the blockwise model's
    10 MiB did not hold (16 MiB with the previous block's dK, dV freed, as now)."""
    B = min(FLASH_BACKWARD_BLOCK, keys)
    return 4 * arch.kv_heads * B * arch.head_dim * b + arch.heads * queries * arch.head_dim * b


def self_scores(arch: Arch, layer: LayerSpec, t: int, acc: int) -> float:
    """Dense self part of attention: [heads, T, T] scores + probs kept for backward."""
    if layer.mixer == "gdn":
        return 0.0
    return 2 * arch.heads * t * min(t, layer.window or t) * acc


def autograd_pass(arch: Arch, tokens: int, keys: int, block: int, b: int, acc: int, dense_self: bool,
                  gdn_kernel: str):
    """(graph bytes, largest transient) of `tokens` queries run with autograd through all
    layers against `keys` held positions: the per-token graph, plus the dense self part's
    [heads, T, T] scores + probs per attention layer; the transient is one layer's
    blockwise-attention backward (or the dense self part's backward), or a torch recurrent
    kernel's backward with the graph below it alive (layers in order: the backward frees
    the later layers' graphs first)."""
    per_token = sum(graph_bytes_per_token(arch, l, b, gdn_kernel) for l in arch.layers) + norm_bytes_per_token(arch, arch.hidden, b)
    graph = tokens * per_token
    attn = max(attention_working(arch, l, tokens, keys, block, acc, backward=True, b=b) for l in arch.layers)
    # a torch recurrent kernel's backward (recompute + backward, `ops/registered.py`) runs when the
    # backward has freed the graph of the layers after it and of its own MLP
    below = 0.0
    for l in arch.layers:
        below += tokens * graph_bytes_per_token(arch, l, b, gdn_kernel)
        back = recurrent_backward_bytes_per_token(arch, l, b, gdn_kernel)
        if back:
            attn = max(attn, below - tokens * mlp_graph_bytes_per_token(arch, l, b) - graph + tokens * back)
        if l.mlp == "moe":  # the combine's backward, the whole graph alive (the MLP's backward runs first)
            attn = max(attn, tokens * moe_backward_bytes_per_token(arch, b))
    if dense_self:
        graph += sum(self_scores(arch, l, tokens, acc) for l in arch.layers)
        attn = max(attn, max(self_scores(arch, l, tokens, acc) for l in arch.layers))
    return graph, attn


def recompute_pass(arch: Arch, tokens: int, keys: int, block: int, b: int, acc: int, dense_self: bool,
                   gdn_kernel: str, last_output_reached: bool = True, mlp_backward: bool = False):
    """(kept, layer moment, layer graph) bytes of `tokens` queries run with autograd, each
    decoder layer recomputed in backward (`models/recompute.py`).

    kept: every layer's input [T, d] (the checkpoints), the final norm's rows (3 x
    [T, d]) and the gradient of the running layer's input, alive through the backward.
    Layer moment: the largest of one layer's backward moments: just after its recompute
    (its whole graph), or in its mixer's backward: attention with the MLP's part already
    freed and the blockwise attention's backward transient (`attention_working`); GDN
    with its whole graph and the chunked kernel's transient (`gdn_kernel_bytes_per_token`,
    no-grad figure). Layer graph: the largest layer's graph. Dense self part: a layer's
    [heads, T, T] scores join both. Check (one detached step, P = 512, R = 1,024 in one
    piece, logits chunk 256, fp32; planner / live tensors): tiny qwen3 1.04, qwen3_5
    1.08, glm_moe_dsa 1.07 (`tests/test_plan_live.py`).

    `last_output_reached=False` (exact mode's reverse walk: no loss on the prompt's own
    tokens): the last layer's output reaches no root, so its attention / MLA backward never
    runs (only its own K/V or latent rows, and a recurrent layer's state, are roots): its
    moment is its graph, without the attention transient. Found on tiny qwen3_5, whose one
    attention layer is the last: the walk's live peak held no attention tiles, and the
    planner was 1.22x it. `mlp_backward=True` adds a dense MLP's backward moment (the
    layer's graph and three [T, intermediate] gradients in acc: d(act*up), d act, d up) for
    every layer whose output is reached; that walk's live peak was there (tiny qwen3_5:
    [2048, 768] float32 gradients of the MLP products). Only the walk passes it (the replay's
    figure was checked without it)."""
    kept = tokens * (len(arch.layers) + 3 + 1) * arch.hidden * b
    moment = graph = 0.0
    for i, layer in enumerate(arch.layers):
        g = tokens * graph_bytes_per_token(arch, layer, b, gdn_kernel)
        g += self_scores(arch, layer, tokens, acc) if dense_self else 0.0
        unreached = not last_output_reached and i == len(arch.layers) - 1 and layer.mixer in ("attention", "mla")
        attn = 0.0 if unreached else attention_working(arch, layer, tokens, keys, block, acc, backward=True, b=b)
        mixer = g - tokens * mlp_graph_bytes_per_token(arch, layer, b) + attn
        if layer.mixer == "gdn":  # the chunked kernel's backward transient, with the layer's graph alive
            back = recurrent_backward_bytes_per_token(arch, layer, b, gdn_kernel)
            if back:  # the torch kernels: the MLP's backward ran first and freed its part of the graph
                mixer = g - tokens * mlp_graph_bytes_per_token(arch, layer, b) + tokens * back
            else:
                mixer = g + tokens * gdn_kernel_bytes_per_token(arch, b, gdn_kernel, graph=False)
        reached = last_output_reached or i < len(arch.layers) - 1
        if mlp_backward and layer.mlp == "dense" and reached:
            mixer = max(mixer, g + 3 * tokens * arch.intermediate * acc)
        if layer.mlp == "moe" and reached:  # the combine's backward, with the layer's whole graph alive
            mixer = max(mixer, g + tokens * moe_backward_bytes_per_token(arch, b))
        moment, graph = max(moment, g, mixer), max(graph, g)
    return kept, moment, graph


def mixer_nograd_bytes_per_token(arch: Arch, layer: LayerSpec, b: int, gdn_kernel: str) -> float:
    """Bytes per token a token mixer holds without autograd, besides its attention
    working set: its projections' outputs (attention: q, k, v, o and the gate; MLA: the
    q / kv down- and up-projections and the indexer's q / k / weights; GDN: the conv input,
    output and z, plus the chunked kernel)."""
    if layer.mixer == "attention":
        return (2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * (2 if arch.attn_gate else 1) * b
    if layer.mixer == "gdn" and arch.recurrent == "mamba2":  # in_proj [z | xBC | dt], the conv's input,
        # output and activation, dt's softplus and clamp
        proj = (arch.gdn_v_heads * arch.gdn_v_dim + 4 * arch.conv_dim + 3 * arch.gdn_v_heads) * b
        return proj + gdn_kernel_bytes_per_token(arch, b, gdn_kernel, graph=False)
    if layer.mixer == "gdn":
        proj = (2 * arch.conv_dim + arch.gdn_v_heads * arch.gdn_v_dim + 2 * arch.gdn_v_heads) * b
        return proj + gdn_kernel_bytes_per_token(arch, b, gdn_kernel, graph=False)
    e = (arch.q_lora_rank or 0) + arch.heads * (arch.nope_dim + arch.rope_dim) + 2 * (arch.kv_lora_rank + arch.rope_dim)
    if layer.indexer:
        e += arch.index_heads * arch.index_dim + arch.index_dim + arch.index_heads
    return e * b


def mlp_nograd_bytes_per_token(arch: Arch, layer: LayerSpec, b: int) -> float:
    """Bytes per token an MLP holds without autograd: act(gate), up and their product (a
    dense SwiGLU); for MoE the router's scores, HF's one-hot expert mask (int64) and
    each token's k expert rows, plus the shared expert."""
    if layer.mlp == "dense":
        return 3 * arch.intermediate * b
    if layer.mlp == "none":  # a Nemotron-H mixer block, Falcon-H1's attention half
        return 0.0
    k, e = arch.experts_per_token, arch.experts
    combined = arch.hidden if arch.expert_ranks > 1 else 0  # expert parallelism: the all-reduced output
    return (3 * e * 4 + k * (e + 1) * 8 + local_choices(arch) * (3 * arch.moe_intermediate + arch.hidden) * b
            + (3 * arch.shared_intermediate + combined) * b)


def nograd_layer_bytes(arch: Arch, layer: LayerSpec, tokens: int, keys: int, block: int, acc: int, b: int,
                       gdn_kernel: str, *, fused: bool) -> float:
    """Peak bytes of one layer run without autograd (capture, scoring) on `tokens` queries
    over `keys` held positions: the larger of its mixer moment and its MLP moment.

    The residual stream: while the mixer runs, the layer's input (also its residual), its
    norm and the embeddings (which HF's model forward holds for the whole pass) are alive,
    3h; while the MLP runs, also the residual after attention, 4h. The mixer moment adds the
    mixer's projections and its attention working set (`fused`: a flash kernel for the
    self part, else the dense [heads, T, T] scores too). Check: tiny qwen3 at P = 4,096 in
    one chunk, 63.98 MB of live tensors = state + 4h + 3I per token (+ RoPE tables).
    """
    h = arch.hidden
    attn = attention_working(arch, layer, tokens, keys, block, acc, backward=False, fused=fused, b=b)
    if not fused:
        attn += self_scores(arch, layer, tokens, acc)
    mixer = tokens * (3 * h * b + mixer_nograd_bytes_per_token(arch, layer, b, gdn_kernel)) + attn
    mlp = tokens * (4 * h * b + mlp_nograd_bytes_per_token(arch, layer, b))
    return max(mixer, mlp)
