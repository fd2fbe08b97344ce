"""The planner's model of expert parallelism (`PlanConfig.expert_parallel`; the engine's
`ExecConfig(expert_parallel=True)`, design in `parallel/experts.py`). Torch-free.

Memory. Each rank holds ceil(E / W) of every MoE layer's E routed experts for good (the
fullest rank's slice; the engine's floor split differs by at most one expert), never
gathered. What is not a routed expert (attention, routers, shared experts, dense MLPs,
embeddings) is replicated, or with `shard_params` (FSDP2 over the decoder layers) the
layers' part sharded 1/W, the embeddings, lm_head and final norm whole, with two decoder layers'
non-expert weights gathered at a time (the largest such layer, counted twice: the running
one and the prefetched next).

Live tensors (`working.py` reads `Arch.expert_ranks`): a rank computes only its local
experts, but HF's grouped_mm / batched_mm forwards still allocate every token's k rows
(`local_choices`), and the combine keeps the all-reduced (or reduce-scattered) output,
[T, H] per MoE layer. A divided capture's MoE call holds every
rank's tokens of its piece, gathered: W x (hidden + routing) rows, and its partial output.

Traffic (bytes one rank receives per MoE layer and per token, the ring model of
`parallel.collectives.Traffic`; w the routing weights' bytes, `routing_weight_bytes`):

    replicated tokens, forward    all-reduce of [T, H]:            2 (W-1)/W H b
                       backward   all-reduce of [T, H + k], one    2 (W-1)/W (H + k) max(b, w)
                                  buffer in the promoted dtype:
    divided tokens,    forward    all-gather of (hidden, weights,  (W-1) (H b + k (w + 8))
                                  top-k) + reduce-scatter:          + (W-1) H b
                       backward   all-gather + reduce-scatter:     (W-1) (2 H b + k w)

(top-k ids int64 (8 B); a divided token is a rank's own row.) A backward through the
last layer's MoE happens in replay only: in exact mode's walk that layer's output reaches
no root of a walk chunk (as `traffic.divided_walk_traffic`), so its combine runs forward
only. Measured against the engine's collectives at W = 2 and 3 on gloo
(tests/comm_worker.py); before that check the planner took w = 4 everywhere, counted the
replicated backward as H b + 4 k (half the bytes for bf16 hidden rows with fp32 weights)
and counted a walk backward through the last layer. The whole-layer gather expert
parallelism replaces moved every expert's weights to every rank, per pass: E x 3 H I x b
bytes per MoE layer.
"""

from __future__ import annotations

import math

from .arch import QUANT_BYTES, DTYPE_BYTES, Arch, layer_linears, layer_other_params


def expert_slice(arch: Arch, world: int) -> float:
    """The fraction of each MoE layer's experts the fullest rank holds: ceil(E / W) / E
    (1 without expert parallelism or experts)."""
    if world <= 1 or not arch.experts:
        return 1.0
    return math.ceil(arch.experts / world) / arch.experts


def local_choices(arch: Arch) -> float:
    """Of each token's k expert choices, the rows a rank's experts forward holds: k, also
    under expert parallelism. HF's grouped_mm and batched_mm forwards (the defaults on
    GPU) allocate all T k rows and zero the other ranks' (measured: the tensors a tiny
    glm_moe_dsa step saves do not shrink, `bench/bench_expert_parallel_live.py`); only its
    eager loop would hold k ceil(E/W)/E on average."""
    return float(arch.experts_per_token)


def divided_moe_working(arch: Arch, piece: int, world: int, b: int) -> float:
    """No-grad bytes of one MoE call of a divided capture under expert parallelism, on a
    rank whose piece holds `piece` tokens (the others' padded to it): its residual stream
    (4 [piece, H]), every rank's gathered hidden rows, routing weights (fp32) and top-k
    ids (int64), the local experts' rows over them (gate, up and act: 3 I, and the
    output H, for k ceil(E/W)/E choices each), the partial output, the router's scores and
    the shared expert over its own rows."""
    h, k, e = arch.hidden, arch.experts_per_token, arch.experts
    rows = world * piece  # (W m): every rank's tokens of this call
    return (piece * (4 * h * b + 3 * e * 4 + 3 * arch.shared_intermediate * b)
            + rows * (2 * h * b + 12 * k + local_choices(arch) * grouped_mm_bytes_per_choice(arch, b)))


def grouped_mm_bytes_per_choice(arch: Arch, b: int) -> float:
    """Peak bytes per (token, choice) pair of HF's grouped_mm experts forward without
    autograd (`transformers.integrations.moe.grouped_mm_experts_forward`, which holds rows
    for every pair, the other ranks' experts' too): the pair's gathered hidden row [H]
    beside the larger of the up projection (its [2I] output and the masked copy) and the
    down one (the masked [H] output, then the routing-weighted output and its un-permuted
    copy, in float32: HF's routers weigh in float32, which promotes a half-precision row),
    plus the pair's int64 expert id, permutations and float32 weight. Found by a GLM-5.2
    rehearsal at P = 2,088,960 on 32 ranks with expert parallelism (`bench/rehearse_attribution.py`):
    the two float32 [T k, H] products were 48 of the capture's 83.6 GiB (4 layers), and
    the term before (3 I + H per pair) left them out (capture planned 0.40 of rehearsed)."""
    h, i, w = arch.hidden, arch.moe_intermediate, max(b, 4)
    return h * b + max(2 * 2 * i * b, h * b + 2 * h * w) + 8 * 4 + 4


def expert_elements(arch: Arch) -> int:
    """Elements of every routed expert of every MoE layer."""
    return sum(arch.experts * sum(a * b for a, b in layer_linears(arch, layer)["experts"]) for layer in arch.layers)


def layer_elements(arch: Arch, layer, *, experts: bool) -> tuple[int, int]:
    """(linear, other) elements of one decoder layer: its linear weights (the routed
    experts' only with `experts`) and its other parameters (norms, biases, convs, routers)."""
    groups = layer_linears(arch, layer)
    linear = sum(a * b for name, shapes in groups.items() if name != "experts" for a, b in shapes)
    if experts:
        linear += arch.experts * sum(a * b for a, b in groups["experts"])
    return linear, layer_other_params(arch, layer)


def largest_non_expert_layer(arch: Arch) -> tuple[int, int]:
    """(linear, other) elements of the decoder layer with the most parameters that are not
    routed experts (what FSDP2 gathers per layer under expert parallelism)."""
    return max((layer_elements(arch, layer, experts=False) for layer in arch.layers), key=sum)


def weight_bytes(elements_linear: float, elements_other: float, wdt: str, b: int) -> float:
    """Stored bytes of linear weights in `wdt` (quantized or float) plus other parameters in b."""
    per = QUANT_BYTES[wdt] if wdt in QUANT_BYTES else DTYPE_BYTES[wdt]
    return elements_linear * per + elements_other * (b if wdt in QUANT_BYTES else DTYPE_BYTES[wdt])


def fsdp2_expert_padding(arch: Arch, world: int) -> float:
    """Routed-expert elements FSDP2 adds on each rank (`shard_params` without expert
    parallelism): it shards a parameter on its first dimension, the expert index of HF's
    fused [E, ..] experts, padded to a multiple of W, so each rank holds ceil(E/W) of E
    experts, not E/W (0 where W divides E). Found by rehearsing a small Qwen3-MoE with 8
    experts at W = 3 (shards of 3): the planner was 5% under its replay."""
    if not arch.experts:
        return 0.0
    return expert_elements(arch) * (math.ceil(arch.experts / world) / arch.experts - 1 / world)


def plan_expert_weights(arch: Arch, base: float, wdt: str, b: int, world: int, shard_params: bool,
                        whole: float = 0.0) -> dict:
    """Per-rank weight bytes under expert parallelism: 'experts' (the rank's slice),
    'rest' (everything else; with `shard_params` the decoder layers' part 1/W and `whole`,
    the bytes FSDP2 leaves unwrapped: embeddings, lm_head, final norm, on every rank),
    'gathered' (two of the largest layer's non-expert weights with `shard_params`, else 0);
    `base` is the whole model's stored weight bytes."""
    experts = weight_bytes(expert_elements(arch), 0, wdt, b)
    rest = base - experts
    linear, other = largest_non_expert_layer(arch)
    return {"experts": experts * expert_slice(arch, world),
            "rest": whole + (rest - whole) / world if shard_params else rest,
            "gathered": 2 * weight_bytes(linear, other, wdt, b) if shard_params else 0.0}


def expert_parallel_weights(arch: Arch, *, base: float, lora_bytes: float, trainable: int, lora: bool, adam: int,
                            wdt: str, b: int, world: int, shard_params: bool, whole: float = 0.0,
                            whole_trained: int = 0) -> tuple[float, float, float, float]:
    """(param, grad, optimizer, gathered) bytes per rank under expert parallelism: the
    experts' slice, the rest replicated or (`shard_params`) the decoder layers' part 1/W
    with `whole` bytes (`whole_trained` trained elements: embeddings, lm_head, final norm)
    on every rank; full training (`lora` False) trains the slice's experts and the rest,
    LoRA only its adapters (all in the decoder layers)."""
    w = plan_expert_weights(arch, base, wdt, b, world, shard_params, whole if shard_params else 0.0)
    rest = world if shard_params else 1
    if lora:
        mine = trainable / rest
    else:
        experts = expert_elements(arch)
        kept = whole_trained if shard_params else 0
        mine = experts * expert_slice(arch, world) + kept + (trainable - experts - kept) / rest
    return w["experts"] + w["rest"] + lora_bytes / rest, mine * b, mine * adam, w["gathered"]


ROUTING_IN_COMPUTE_DTYPE = ("qwen3",)
"""model_type prefixes whose router casts its top-k weights to the compute dtype (HF's
Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE routers: `router_top_value.to(router_logits.dtype)`);
the others (Mixtral, GLM, DeepSeek, MiniMax) keep them in fp32."""


def routing_weight_bytes(arch: Arch, b: int) -> int:
    """Bytes of one routing weight as the experts' combine receives it: b where the router
    casts to the compute dtype (`ROUTING_IN_COMPUTE_DTYPE`), else fp32's 4."""
    return b if arch.model_type.startswith(ROUTING_IN_COMPUTE_DTYPE) else 4


def moe_backward_bytes_per_token(arch: Arch, b: int) -> float:
    """Transient bytes per token of an MoE layer's backward through HF's grouped_mm combine
    (`grouped_mm_experts_forward`: the routing-weighted rows un-permuted, then summed over
    each token's k choices), beside the layer's graph: the sum's gradient materialised as
    [T k, H] (`ViewBackward0` over the expanded sum) and the un-permute's (`IndexBackward0`:
    zeros [T k, H] and the indexed write), each in the promoted dtype (max(b, routing
    weight); float32 for HF's float32 routers), and the [T, H] cast back. Found by
    rehearsing GLM-5.2 (the preset cut to 4 layers, P = 131,072 on 32 ranks, expert parallel,
    FSDP2, `bench/rehearse_attribution.py --phase replay`): replay's peak is in that backward,
    three float32 [T k, H] of 1.5 GiB at T = 8,192, which the planner's replay left out
    (planned 0.87 of rehearsed). A real CPU run holds the same three (an in-place indexed
    write on CUDA may hold two)."""
    return (3 * local_choices(arch) + 1) * arch.hidden * max(b, routing_weight_bytes(arch, b))


def combine_bytes_per_token(arch: Arch, world: int, b: int) -> dict:
    """Bytes one rank receives per MoE layer and per token, by kind of tokens and pass
    (the table in the module docstring)."""
    W, h, k, w = world, arch.hidden, arch.experts_per_token, routing_weight_bytes(arch, b)
    ring = 2 * (W - 1) / W
    return {"replicated_forward": ring * h * b, "replicated_backward": ring * (h + k) * max(b, w),
            "divided_forward": (W - 1) * (2 * h * b + k * (w + 8)), "divided_backward": (W - 1) * (2 * h * b + k * w)}


def expert_phase_traffic(s, *, divided_capture: bool, divided_walk: bool, recompute: bool) -> dict:
    """The combines' bytes per rank in each phase ('capture', 'replay', 'walk') for a
    `config.Basis` `s` (zeros without expert parallelism). Replay counts G R replicated
    tokens (forward twice with a layer-wise recompute, plus score passes; the no-grad
    forward of held pieces is not counted); the walk, a rank's own tokens (divided) or
    every prompt token (replicated), forward and backward."""
    c, arch = s.config, s.arch
    if not c.expert_parallel:
        return {"capture": 0.0, "replay": 0.0, "walk": 0.0}

    def t(**kw):
        base = dict(replicated_forward=0, replicated_backward=0, divided_forward=0, divided_backward=0)
        return expert_parallel_traffic(arch, s.W, s.b, **{**base, **kw})

    replay = s.G * s.R
    walk = 0.0
    if s.exact:
        walk = (t(divided_forward=s.p_rank, divided_backward=s.p_rank) if divided_walk
                else t(replicated_forward=s.P, walk_backward=s.P))
    return {"capture": t(divided_forward=s.p_rank) if divided_capture else t(replicated_forward=s.P),
            "replay": t(replicated_forward=replay * ((2 if recompute else 1) + c.score_passes),
                        replicated_backward=replay),
            "walk": walk}


def expert_report(s, *, divided_capture: bool, divided_walk: bool, recompute: bool) -> dict:
    """The report's expert-parallel figures for a `config.Basis` `s`: whether it is on,
    the combines' bytes per rank over a step (`expert_phase_traffic`'s sum), and their
    breakdown."""
    c, arch = s.config, s.arch
    if not c.expert_parallel:
        return {"expert_parallel": False, "expert_comm_bytes_per_rank": 0.0}
    total = sum(expert_phase_traffic(s, divided_capture=divided_capture, divided_walk=divided_walk,
                                     recompute=recompute).values())
    return {"expert_parallel": True, "expert_comm_bytes_per_rank": total,
            "experts": {"experts_per_rank": math.ceil(arch.experts / s.W), "experts": arch.experts,
                        "moe_layers": arch.count(mlp="moe"),
                        "bytes_per_token_per_moe_layer": combine_bytes_per_token(arch, s.W, s.b)}}


def expert_parallel_traffic(arch: Arch, world: int, b: int, *, replicated_forward: float, replicated_backward: float,
                            divided_forward: float, divided_backward: float, walk_backward: float = 0.0) -> float:
    """Bytes one rank receives over a step for the MoE combines, given how many tokens
    pass through the MoE layers in each way: replicated tokens forward and backward
    (replay's: every MoE layer), a rank's own (divided) tokens forward and backward, and
    a replicated walk's backward tokens. A walk's backward (`divided_backward`,
    `walk_backward`) skips a final-layer MoE (see the module docstring)."""
    per = combine_bytes_per_token(arch, world, b)
    moe = arch.count(mlp="moe")
    walked = moe - (1 if arch.layers and arch.layers[-1].mlp == "moe" else 0)  # MoE layers a walk's backward crosses
    return (moe * (replicated_forward * per["replicated_forward"] + replicated_backward * per["replicated_backward"]
                   + divided_forward * per["divided_forward"])
            + walked * (divided_backward * per["divided_backward"] + walk_backward * per["replicated_backward"]))
