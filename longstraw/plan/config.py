"""The planner's inputs: `PlanConfig` (one GRPO step to plan for; its execution defaults are
`ExecConfig`'s, from `longstraw/defaults.py`) and `Basis`, what a config resolves to for one
model (its architecture, dtype bytes, parameter counts and sizes). Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .. import defaults
from ..defaults import MODES
from ..errors import ConfigError
from ..parallel.deal import Deal
from .arch import (
    DTYPE_BYTES,
    GDN_KERNELS,
    LORA_TARGETS,
    QUANT_BYTES,
    SELF_ATTENTION,
    Arch,
    ParamCount,
    architecture,
    canonical_dtype,
    count_parameters,
    load_model_config,
    parse_bytes,
)
from .gpus import gpu_spec
from .tree import parse_tree

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

    mode: str = defaults.MODE
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

    chunk_size: int = defaults.CHUNK_SIZE
    """Capture chunk (ExecConfig.chunk_size)."""

    branch_chunk_size: int | None = defaults.BRANCH_CHUNK_SIZE
    """Replay each branch in pieces of this many tokens (ExecConfig.branch_chunk_size;
    the paper: 2048). None: one piece of R tokens."""

    attention_block_size: int = defaults.ATTENTION_BLOCK_SIZE
    """Prompt positions per block of the blockwise attention (ExecConfig)."""

    replay_batch: int | None = defaults.REPLAY_BATCH
    """Branches of one piece replayed together as one batch (ExecConfig.replay_batch): the
    replay graph is then one piece of min(replay_batch, G) x R tokens over the same prompt
    state. 1: one branch at a time. None: the engine's rule (`defaults.replay_batch_for`,
    `memory.replay_batch`); the report's "replay_batch" says what it chose."""

    recompute_layers: bool | None = defaults.RECOMPUTE_LAYERS
    """Replay recomputes each decoder layer in backward (ExecConfig.recompute_layers): a
    piece's graph is every layer's input plus one layer's activations, for one more
    forward of the piece's layers. None: the engine's rule (`defaults.recompute_pays`:
    where a piece's graph would exceed twice the weights + gradients + state the step
    holds anyway; `--fit` turns it on where the budget needs it)."""

    shard_block_size: int | None = None
    """Context parallelism: prompt positions per round-robin block of the deal
    (`ExecConfig.shard_block_size`): which rank owns a position, the fullest rank's share,
    whether every rank owns a block (a divided capture or walk), and the divided passes'
    traffic. None: `attention_block_size` (as the engine)."""

    logits_chunk_size: int = defaults.LOGITS_CHUNK_SIZE
    """Response tokens per lm_head + log-softmax chunk (ExecConfig)."""

    offload_snapshots: bool | None = defaults.OFFLOAD_SNAPSHOTS
    """Exact mode: the recurrent layers' per-chunk snapshots (all but the latest) in host
    memory, one staged back per walk chunk (ExecConfig.offload_snapshots). None: when
    the state is offloaded (`offload_state`)."""

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

    expert_parallel: bool = False
    """MoE models under context parallelism (W > 1): each rank holds ceil(E / W) of every
    MoE layer's routed experts for good, never gathered whole (`ExecConfig(expert_parallel
    =True)`); with `shard_params`, only the non-expert weights are sharded and gathered.
    The combines' traffic is reported (`plan/experts.py`)."""

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

    keep_graph_bytes: int | str = defaults.KEEP_GRAPH_BYTES
    """Exact mode (`ExecConfig.keep_graph_bytes`): bytes of capture-chunk autograd graphs
    kept instead of recomputed. The planner keeps as many of the last chunks as fit at its
    estimate of one chunk's graph; they are alive from capture to the reverse walk."""

    keep_attention_outputs: bool | None = defaults.KEEP_ATTENTION_OUTPUTS
    """Exact mode (`ExecConfig.keep_attention_outputs`): capture keeps every attention
    layer's output and LSE per prompt position (H * (Dv * b + acc) bytes per position and
    layer, on the device, from capture until the walk passes each chunk), so the walk's
    recomputed forward skips attention over the prompt (its backward runs from them). The
    engine applies it on a replicated walk (not to MLA / DSA layers or attention sinks);
    `fit_config` offers it on CPU only (not yet measured on a GPU), `--fit` never. None:
    the engine's rule (`defaults.keeps_attention_outputs`, with `fused_backward`)."""

    fused_backward: bool = False
    """The device runs torch's fused flash-attention backward (`ops/flash.fused_backward_kernel`:
    CPU today; a GPU's walk runs the blockwise one). The engine's default for
    `keep_attention_outputs` (None) keeps the outputs only there; `fit_config` sets it
    from the model's device."""

    divide_capture: bool = defaults.DIVIDE_CAPTURE
    """Under context parallelism (W > 1), capture computes each prompt token on one rank
    (`ExecConfig.divide_capture`; every family, but not with kept graphs or an offloaded
    state, and only when every rank owns a block). False: capture's token computation is
    replicated on every rank."""

    divide_walk: bool = defaults.DIVIDE_WALK
    """Exact mode under context parallelism (W > 1): the reverse walk recomputes and
    backpropagates each prompt token on one rank (`ExecConfig.divide_walk`; every family,
    also with `shard_params`; not with kept graphs or an offloaded state, and only when
    every rank owns a block).
    False: the walk's token computation is replicated on every rank."""

    throughput_tflops: float = 400.0
    """Effective dense throughput per rank, TFLOP/s (default 400: an H100/H200-class GPU
    at ~40-50% of its bf16 peak; an H20 is ~148 peak)."""

    gpu: str | None = None
    """A GPU preset (`plan/gpus.json`: h20, h100, h200, b200, a100-80gb, mi300x): sets
    `gpu_memory`, `throughput_tflops` (bf16 dense peak x the stated efficiency) and the
    link bandwidths, each where the field is left at its default (`plan/gpus.py`)."""

    gpus_per_node: int = 8
    """GPUs per node: a group of at most this many ranks talks over the intra-node link,
    a larger one over the per-GPU inter-node bandwidth (the slowest hop bounds a ring)."""

    intra_node_gbs: float = 360.0
    """Effective one-direction intra-node bandwidth per GPU, GB/s (default: NVLink 4's
    900 GB/s aggregate, halved, x 0.8; a `gpu` preset sets its own)."""

    inter_node_gbs: float = 40.0
    """Effective per-GPU inter-node bandwidth, GB/s (default: one 400 Gb/s NIC per GPU,
    50 GB/s, x 0.8)."""

    data_parallel: int = 1
    """Data-parallel replicas of the W context-parallel ranks (W x data_parallel GPUs in
    all): the trainable gradients are all-reduced over them once per step."""

    images: int = 0
    """Images in the prompt (`Group.prompt_inputs`, `plan/vision.py`): their tower's
    parameters, the rows the state keeps, and the largest image's working set are added.
    Qwen3.5 / 3.6 families only; under context parallelism every rank holds them whole, and
    with state offload the rows stay on the device (as the engine: docs/vision.md)."""

    image_tokens: int = 0
    """Merged tokens of the largest image (HF's t * h * w / merge^2): each image counts this many."""

    generate: bool = False
    """The step's responses are sampled by `Engine.generate` from the state the step then
    reuses (`step(group, state=rollout.state)`, as `longstraw train` and the TRL trainer
    do): adds the 'generate' phase, the G branches decoding together (their own state for
    R + 1 positions, the logits and sampling temporaries, `plan/generate.py`). The search
    then offers no kept capture graphs or attention outputs (generate's capture keeps
    neither, so a step reusing its state has none)."""

    tree: object = None
    """A prefix tree of the responses (`plan/tree.py`): levels [(segment_tokens, fan_out), ...]
    below the prompt, e.g. [(2048, 1), (256, 8)] (8 responses share 2,048 tokens, then 256
    each), or the CLI's "2048x1,256x8". Sets `group` (the leaves) and `response_tokens` (the
    segments' sum); each shared segment is replayed once. None: G flat responses."""

    share_response_prefixes: bool = defaults.SHARE_RESPONSE_PREFIXES
    """`ExecConfig.share_response_prefixes` (docs/trees.md): with a `tree`, True plans the
    engine's tree path (each shared segment once, `plan/tree_cost.py`); False plans the G
    responses of R tokens replayed flat, as the engine then runs them. No effect without a tree."""

    def __post_init__(self):
        if self.gpu is not None:
            for name, value in gpu_spec(self.gpu).plan_fields().items():  # where the field is at its default
                if getattr(self, name) == _DEFAULTS[name]:
                    setattr(self, name, value)
            self.gpu = self.gpu.lower()
        for name in ("gpus_per_node", "data_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PlanConfig.{name} must be a positive int, got {value!r}")
        for name in ("intra_node_gbs", "inter_node_gbs"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"PlanConfig.{name} must be a number > 0, got {value!r}")
        if not isinstance(self.share_response_prefixes, bool):
            raise ConfigError(f"PlanConfig.share_response_prefixes must be True or False, got "
                              f"{self.share_response_prefixes!r}")
        if self.tree is not None:
            self.tree = parse_tree(self.tree)
            self.group, self.response_tokens = math.prod(f for _, f in self.tree), sum(n for n, _ in self.tree)
        for name in ("prompt_tokens", "group", "response_tokens", "gpus", "chunk_size", "attention_block_size",
                     "logits_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PlanConfig.{name} must be a positive int, got {value!r}")
        for name in ("lora_rank", "branch_chunk_size", "shard_block_size", "replay_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"PlanConfig.{name} must be a positive int or None, got {value!r}")
        if self.recompute_layers is not None and not isinstance(self.recompute_layers, bool):
            raise ConfigError(f"PlanConfig.recompute_layers must be True, False or None, got {self.recompute_layers!r}")
        if self.offload_snapshots is not None and not isinstance(self.offload_snapshots, bool):
            raise ConfigError(f"PlanConfig.offload_snapshots must be True, False or None, got "
                              f"{self.offload_snapshots!r}")
        if not isinstance(self.generate, bool):
            raise ConfigError(f"PlanConfig.generate must be True or False, got {self.generate!r}")
        if isinstance(self.score_passes, bool) or not isinstance(self.score_passes, int) or self.score_passes < 0:
            raise ConfigError(f"PlanConfig.score_passes must be an int >= 0, got {self.score_passes!r}")
        if not (isinstance(self.host_bandwidth_gbs, (int, float)) and math.isfinite(self.host_bandwidth_gbs)
                and self.host_bandwidth_gbs > 0):
            raise ConfigError(f"PlanConfig.host_bandwidth_gbs must be a number > 0, got {self.host_bandwidth_gbs!r}")
        if self.expert_parallel and self.gpus < 2:
            raise ConfigError("PlanConfig.expert_parallel splits the experts over the ranks: give gpus >= 2 "
                              f"(got {self.gpus}), or drop expert_parallel")
        if self.mode not in MODES:
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
        self._check_images()
        self.gpu_memory = parse_bytes(self.gpu_memory)
        self.reserve = parse_bytes(self.reserve)
        self.keep_graph_bytes = parse_bytes(self.keep_graph_bytes)
        if self.offload_state and self.keep_attention_outputs:
            raise ConfigError("PlanConfig.offload_state with keep_attention_outputs: the engine refuses kept attention "
                              "outputs with an offloaded state; drop one of the two")
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

    def _check_images(self) -> None:
        for name in ("images", "image_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"PlanConfig.{name} must be an int >= 0, got {value!r}")
        if not self.images:
            return
        if self.image_tokens < 1 or self.images * (self.image_tokens + 2) >= self.prompt_tokens:
            raise ConfigError(f"PlanConfig: {self.images} images of {self.image_tokens} tokens (+ their vision start / "
                              f"end tokens) must fit in prompt_tokens={self.prompt_tokens} with text after them; "
                              "give image_tokens >= 1 and fewer or smaller images")


_DEFAULTS = {"gpu_memory": "96GiB", "throughput_tflops": 400.0, "host_bandwidth_gbs": 50.0,
             "intra_node_gbs": 360.0, "inter_node_gbs": 40.0}
"""PlanConfig's defaults of the fields a GPU preset sets (kept equal to the field defaults: a test)."""


@dataclass(frozen=True)
class Basis:
    """What a `PlanConfig` resolves to for one model: the figures every section reads.

    Fields:
        name / cfg / preset: the model's name, HF-style config dict and preset metadata.
        arch / params: its normalized architecture and parameter counts.
        config: the plan's inputs.
        dtype / wdt: compute (state, activation) dtype and frozen weight storage.
        b / acc / rb: bytes of the compute dtype, of the attention / softmax accumulation
            (fp32; fp64 under fp64) and of the GDN recurrent state (fp32; fp64 under fp64).
        P / R / G / W: prompt tokens, response tokens, group size, ranks.
        deal: the round-robin deal of prompt positions over the W ranks.
        p_rank: prompt positions on the fullest rank (all P for one rank).
    """

    name: str
    cfg: dict
    preset: dict
    arch: Arch
    params: ParamCount
    config: PlanConfig
    dtype: str
    wdt: str
    b: int
    acc: int
    rb: int
    P: int
    R: int
    G: int
    W: int
    deal: Deal
    p_rank: int

    @property
    def exact(self) -> bool:
        return self.config.mode == "exact"

    @property
    def block(self) -> int:
        """Positions per block of the deal over the ranks (`PlanConfig.shard_block_size`,
        else the attention block, as the engine's `rank_shard`)."""
        return self.deal.block

    @property
    def every_rank_owns(self) -> bool:
        """Every rank holds a position of the P - 1 captured ones (the engine's condition
        for dividing capture or the walk)."""
        return self.deal.count(self.P - 1, self.W - 1) > 0


def resolve(model, config: PlanConfig) -> Basis:
    """The `Basis` of planning `model` (preset name, config.json path, or config dict)."""
    name, cfg, preset = load_model_config(model)
    arch = architecture(cfg)
    c = config
    dtype = c.dtype or arch.dtype or "bfloat16"
    b = DTYPE_BYTES[dtype]  # activations, state, trainable params
    wdt = c.weight_dtype or dtype
    if wdt in QUANT_BYTES and arch.count(mixer="mla"):
        raise ConfigError(f"weight_dtype {wdt!r}: the engine refuses quantized base weights for MLA models "
                          "(absorbed MLA needs kv_b_proj as a float matrix); plan them in bf16")
    if c.expert_parallel:
        if not arch.experts:
            raise ConfigError(f"PlanConfig.expert_parallel but {name} has no routed experts; drop expert_parallel")
        arch = replace(arch, expert_ranks=c.gpus)
    if c.images and cfg.get("model_type") not in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        raise ConfigError(f"PlanConfig.images: {name} ({cfg.get('model_type')}) runs text prompts only; images run on "
                          "the Qwen3.5 / 3.6 families (docs/vision.md)")
    if c.gpus > 1:
        arch = replace(arch, context_ranks=c.gpus)
    if c.lora_rank:
        arch = replace(arch, lora=(c.lora_rank, c.lora_targets))
    deal = Deal(c.gpus, c.shard_block_size or c.attention_block_size)
    return Basis(name=name, cfg=cfg, preset=preset, arch=arch, config=c,
                 params=count_parameters(arch, c.lora_rank, c.lora_targets), dtype=dtype, wdt=wdt, b=b,
                 acc=8 if dtype == "float64" else 4, rb=max(4, b), P=c.prompt_tokens, R=c.response_tokens,
                 G=c.group, W=c.gpus, deal=deal, p_rank=deal.fullest(c.prompt_tokens))
