"""Capacity planner: how much memory and time one LongStraw GRPO step needs, from a
model config alone (no weights are loaded and no model is built; this module uses no torch).

    report = estimate("qwen3.6-27b", PlanConfig(prompt_tokens=2_088_960, group=8,
                                                response_tokens=8192, gpus=8))
    report["peak_bytes_per_rank"], report["fits"], report["estimated_time_s"]

`model` is a preset name (`presets.json`, next to this file: HF-style configs with the
source of every figure), a path to a Hugging Face `config.json`, or a config dict.

What is counted (docs/planner.md has every formula and assumption):

* **State** (what capture keeps, per layer): K/V per KV head of full-attention layers,
  the MLA latent + shared rope key, the DSA indexer keys (all three per prompt token);
  the Gated DeltaNet recurrent state (fp32) + conv tail and the last W-1 positions of
  sliding-window layers (constant in P).
* **Static** memory per rank: weights, gradients and Adam state of what is trained (the
  whole model, or LoRA adapters), and the state sharded 1/W under context parallelism
  (per-token part; the constant part is replicated). Exact mode adds a gradient buffer the
  size of the state and, for recurrent layers, the recurrent state at each chunk start.
* **Working** sets, of which only the largest is alive at once: capture of one chunk (no
  autograd), replay of one branch (or one piece of it) with autograd, and in exact mode the
  recompute of one chunk with autograd.
* **Time** from FLOPs at a stated effective throughput, divided over W ranks.

These are estimates of an engine that works as DESIGN.md says, not measurements.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import ConfigError, UnsupportedModelError

PRESETS_PATH = Path(__file__).with_name("presets.json")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next",
                         "glm_moe_dsa", "deepseek_v32", "deepseek_v3")
# nested text configs of the multimodal Qwen3.5 checkpoints
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp64": "float64", "f64": "float64", "double": "float64", "fp32": "float32", "f32": "float32",
                  "float": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16"}
# Storage of quantized linear weights, bytes per parameter. NF4 with double quantization
# (QLoRA): 4 bits + 0.127 bits of block constants. FP8/INT8: 1 byte (scales ignored).
QUANT_BYTES = {"nf4": 4.127 / 8, "fp8": 1.0, "int8": 1.0}

NF4 = "nf4"
BACKWARD_FACTOR = 2.0  # backward FLOPs ~ 2x forward (input grads + weight grads)
GDN_CHUNK = 64  # chunked delta-rule kernels keep one [v_heads, dk, dv] fp32 state per 64 tokens
LORA_TARGETS = ("attention", "all-linear")
SELF_ATTENTION = ("dense", "fused-nograd", "flash")


# ----------------------------------------------------------------------------
# units


def parse_bytes(text) -> int:
    """'96GB' -> 96e9, '96GiB' -> 96 * 2**30, '512MiB', '1.5TB', 1024 -> 1024.

    SI units (KB, MB, GB, TB) are powers of 1000; binary ones (KiB, MiB, GiB, TiB) and the
    bare letters (K, M, G, T) are powers of 1024. A bare number is bytes.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a memory size must be >= 0, got {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot read memory size {text!r}: write e.g. 96GB (10^9 bytes) or 96GiB (2^30 bytes)")
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        return int(value)
    power = "kmgt".index(unit[0]) + 1
    base = 1000 if unit.endswith("b") and not unit.endswith("ib") else 1024
    return int(round(value * base**power))


def _canonical_dtype(name: str, *, allow_quant: bool = False) -> str:
    key = str(name).lower().replace("torch.", "")
    key = _DTYPE_ALIASES.get(key, key)
    if key in DTYPE_BYTES or (allow_quant and key in QUANT_BYTES):
        return key
    have = sorted(DTYPE_BYTES) + (sorted(QUANT_BYTES) if allow_quant else [])
    raise ConfigError(f"unknown dtype {name!r}; use one of {have} (or bf16, fp16, fp32, fp64)")


def human_bytes(n: float) -> str:
    """1234567890 -> '1.15 GiB (1.23 GB)'."""
    for unit, p in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**p:
            return f"{n / 1024**p:,.2f} {unit} ({n / 1000**p:,.2f} {unit.replace('i', '')})"
    return f"{int(n):,} B"


# ----------------------------------------------------------------------------
# model configs -> a normalized architecture


def load_presets() -> dict:
    """The preset table: name -> {'config', 'num_parameters', ..., '_source'}."""
    with open(PRESETS_PATH) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if not k.startswith("_")}


def load_model_config(model) -> tuple[str, dict, dict]:
    """(name, HF-style config dict, preset metadata) for a preset name, a config.json
    path (or a directory holding one), or a config dict."""
    if isinstance(model, dict):
        return str(model.get("_name_or_path") or model.get("model_type", "config")), dict(model), {}
    presets = load_presets()
    key = str(model)
    if key in presets or key.lower() in presets:
        entry = presets[key if key in presets else key.lower()]
        return key.lower(), dict(entry["config"]), entry
    path = Path(os.path.expanduser(key))
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"{str(path)!r} is not a JSON object (an HF config.json)")
        return str(path), config, {}
    raise ConfigError(f"unknown model {key!r}: not a preset and not a path to a config.json. "
                      f"Presets: {', '.join(sorted(presets))}")


@dataclass
class LayerSpec:
    """One decoder layer as the planner sees it.

    mixer: "attention" (GQA/MQA), "gdn" (Gated DeltaNet) or "mla".
    window: sliding window W of an attention layer, or None.
    indexer: an MLA layer that runs its own DSA indexer (keeps indexer keys).
    sparse: an MLA layer whose attention reads only the DSA top-k keys.
    mlp: "dense" or "moe".
    """

    mixer: str
    mlp: str = "dense"
    window: int | None = None
    indexer: bool = False
    sparse: bool = False


@dataclass
class Arch:
    """A normalized decoder-only architecture (the fields the planner needs)."""

    model_type: str
    layers: list
    hidden: int
    vocab: int
    tie_embeddings: bool
    heads: int
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    attn_gate: bool = False
    qkv_bias: bool = False
    intermediate: int = 0
    # MoE
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # total width of the shared expert(s)
    qwen_moe: bool = False  # router + shared-expert gate (Qwen) vs router + score bias (DeepSeek/GLM)
    # Gated DeltaNet
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_kernel: int = 0
    gdn_split_proj: bool = True  # Qwen3.5: in_proj_qkv/z/b/a; Qwen3-Next: in_proj_qkvz/ba
    # MLA + DSA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_head_dim: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    max_positions: int | None = None
    dtype: str | None = None

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    def count(self, **match) -> int:
        return sum(all(getattr(l, k) == v for k, v in match.items()) for l in self.layers)


def _get(cfg: dict, name: str, default=None):
    value = cfg.get(name, default)
    return default if value is None else value


def _need(cfg: dict, *names: str) -> None:
    missing = [n for n in names if cfg.get(n) is None]
    if missing:
        raise ConfigError(f"{cfg.get('model_type')} config lacks {missing}: the planner needs them")


def architecture(config: dict) -> Arch:
    """Normalize an HF config dict of a supported family into an `Arch`."""
    cfg = dict(config)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrapper (Qwen3.5): use the text model
        text = dict(cfg["text_config"])
        text.setdefault("model_type", cfg.get("model_type"))
        dtype = dtype or text.get("torch_dtype") or text.get("dtype")
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        cfg = text
    mt = _TEXT_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {cfg.get('model_type')!r} is not supported by the planner; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    _need(cfg, "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    n, h, heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    arch = Arch(model_type=mt, layers=[], hidden=h, vocab=int(cfg["vocab_size"]),
                tie_embeddings=bool(_get(cfg, "tie_word_embeddings", False)), heads=heads,
                kv_heads=int(_get(cfg, "num_key_value_heads", heads)),
                head_dim=int(_get(cfg, "head_dim", h // heads)),
                intermediate=int(_get(cfg, "intermediate_size", 0)),
                max_positions=cfg.get("max_position_embeddings"),
                dtype=_canonical_dtype(dtype) if dtype else None)
    if mt in ("llama", "mistral", "qwen2", "qwen3"):
        arch.qk_norm = mt == "qwen3"
        arch.qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if types is None:
            if mt == "mistral":
                types = ["sliding_attention" if window else "full_attention"] * n
            elif mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
                first = int(_get(cfg, "max_window_layers", n))
                types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
            else:
                types = ["full_attention"] * n
        arch.layers = [LayerSpec("attention", window=int(window) if t == "sliding_attention" and window else None)
                       for t in types]
    elif mt in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        _need(cfg, "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim")
        arch.qk_norm, arch.attn_gate = True, True
        arch.gdn_k_heads, arch.gdn_v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        arch.gdn_k_dim, arch.gdn_v_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        arch.gdn_kernel = int(_get(cfg, "linear_conv_kernel_dim", 4))
        arch.gdn_split_proj = mt != "qwen3_next"
        types = cfg.get("layer_types")
        if types is None:
            every = int(_get(cfg, "full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        if mt == "qwen3_5":
            mlps = ["dense"] * n
        else:
            _need(cfg, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
            arch.experts, arch.experts_per_token = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
            arch.moe_intermediate = int(cfg["moe_intermediate_size"])
            arch.shared_intermediate = int(_get(cfg, "shared_expert_intermediate_size", 0))
            arch.qwen_moe = True
            step, dense_only = int(_get(cfg, "decoder_sparse_step", 1)), set(_get(cfg, "mlp_only_layers", []))
            mlps = ["dense" if (i in dense_only or (i + 1) % step) else "moe" for i in range(n)]
        arch.layers = [LayerSpec("gdn" if t == "linear_attention" else "attention", mlp=m) for t, m in zip(types, mlps)]
    else:  # MLA family: deepseek_v3, deepseek_v32, glm_moe_dsa
        _need(cfg, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        arch.q_lora_rank = cfg.get("q_lora_rank")
        arch.kv_lora_rank, arch.rope_dim = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        arch.nope_dim, arch.v_head_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        arch.head_dim = arch.nope_dim + arch.rope_dim
        arch.kv_heads = heads
        arch.experts = int(_get(cfg, "n_routed_experts", 0))
        arch.experts_per_token = int(_get(cfg, "num_experts_per_tok", 0))
        arch.moe_intermediate = int(_get(cfg, "moe_intermediate_size", 0))
        arch.shared_intermediate = int(_get(cfg, "n_shared_experts", 0)) * arch.moe_intermediate
        mlps = cfg.get("mlp_layer_types")
        if mlps is None:
            k = min(int(_get(cfg, "first_k_dense_replace", 0)), n)
            mlps = ["dense"] * k + ["sparse"] * (n - k)
        mlps = ["moe" if m == "sparse" and arch.experts else "dense" for m in mlps]
        dsa = mt in ("deepseek_v32", "glm_moe_dsa")
        indexer = [False] * n
        if dsa:
            _need(cfg, "index_n_heads", "index_head_dim", "index_topk")
            arch.index_heads, arch.index_dim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
            arch.index_topk = int(cfg["index_topk"])
            types = cfg.get("indexer_types")
            if types is None and cfg.get("index_topk_pattern") is not None:
                pattern = cfg["index_topk_pattern"]
                types = ([{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(pattern, str)
                         else list(pattern))
            if types is None and mt == "glm_moe_dsa":  # transformers' GlmMoeDsaConfig schedule
                freq = max(int(_get(cfg, "index_topk_freq", 1)), 1)
                offset = int(_get(cfg, "index_skip_topk_offset", 2))
                types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
            indexer = [t == "full" for t in types] if types is not None else [True] * n
        arch.layers = [LayerSpec("mla", mlp=m, indexer=ix, sparse=dsa) for m, ix in zip(mlps, indexer)]
    if len(arch.layers) != n:
        raise ConfigError(f"layer_types has {len(arch.layers)} entries but num_hidden_layers is {n}")
    if any(l.mlp == "dense" for l in arch.layers) and not arch.intermediate:
        raise ConfigError(f"{mt} config lacks intermediate_size for its dense MLP layers")
    return arch


# ----------------------------------------------------------------------------
# parameters


def _linears(arch: Arch, layer: LayerSpec) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of each linear layer of one decoder layer, by group:
    'mixer' (attention / GDN / MLA projections), 'indexer', 'mlp' (dense or shared
    expert), 'experts' (routed experts: n x 3 linears)."""
    h = arch.hidden
    groups: dict[str, list[tuple[int, int]]] = {"mixer": [], "indexer": [], "mlp": [], "experts": []}
    if layer.mixer == "attention":
        q_out = arch.heads * arch.head_dim * (2 if arch.attn_gate else 1)
        kv = arch.kv_heads * arch.head_dim
        groups["mixer"] = [(h, q_out), (h, kv), (h, kv), (arch.heads * arch.head_dim, h)]
    elif layer.mixer == "gdn":
        kd, vd, nv = arch.gdn_k_heads * arch.gdn_k_dim, arch.gdn_v_heads * arch.gdn_v_dim, arch.gdn_v_heads
        if arch.gdn_split_proj:  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
            groups["mixer"] = [(h, 2 * kd + vd), (h, vd), (h, nv), (h, nv), (vd, h)]
        else:  # in_proj_qkvz, in_proj_ba, out_proj
            groups["mixer"] = [(h, 2 * kd + 2 * vd), (h, 2 * nv), (vd, h)]
    else:
        H, qk = arch.heads, arch.nope_dim + arch.rope_dim
        q = [(h, arch.q_lora_rank), (arch.q_lora_rank, H * qk)] if arch.q_lora_rank else [(h, H * qk)]
        groups["mixer"] = q + [(h, arch.kv_lora_rank + arch.rope_dim),
                               (arch.kv_lora_rank, H * (arch.nope_dim + arch.v_head_dim)),
                               (H * arch.v_head_dim, h)]
        if layer.indexer:  # wq_b, wk, weights_proj
            groups["indexer"] = [(arch.q_lora_rank or h, arch.index_heads * arch.index_dim),
                                 (h, arch.index_dim), (h, arch.index_heads)]
    if layer.mlp == "dense":
        groups["mlp"] = [(h, arch.intermediate)] * 2 + [(arch.intermediate, h)]
    else:
        if arch.shared_intermediate:
            groups["mlp"] = [(h, arch.shared_intermediate)] * 2 + [(arch.shared_intermediate, h)]
        groups["experts"] = [(h, arch.moe_intermediate)] * 2 + [(arch.moe_intermediate, h)]
    return groups


def _other_params(arch: Arch, layer: LayerSpec) -> int:
    """Non-linear parameters of one layer: norms, biases, conv, router, gates."""
    h = arch.hidden
    n = 2 * h  # input + post-attention norm
    if layer.mixer == "attention":
        n += 2 * arch.head_dim if arch.qk_norm else 0
        n += (arch.heads + 2 * arch.kv_heads) * arch.head_dim if arch.qkv_bias else 0
    elif layer.mixer == "gdn":
        n += arch.conv_dim * arch.gdn_kernel + 2 * arch.gdn_v_heads + arch.gdn_v_dim  # conv, A_log, dt_bias, norm
    else:
        n += (arch.q_lora_rank or 0) + arch.kv_lora_rank  # q_a / kv_a norms
        n += 2 * arch.index_dim if layer.indexer else 0  # indexer k_norm (LayerNorm)
    if layer.mlp == "moe":
        n += h * arch.experts + (h if arch.qwen_moe and arch.shared_intermediate else 0)  # router, shared gate
        n += 0 if arch.qwen_moe else arch.experts  # score-correction bias
    return n


@dataclass
class ParamCount:
    """Parameter counts (elements) by role."""

    total: int
    active: int  # per token: routed experts counted k of n
    embedding: int
    lm_head: int
    linear: int  # body linear weights (incl. experts and indexer): what NF4/FP8 quantizes
    other: int  # norms, biases, convs, routers
    lora: int  # adapter parameters (0 without LoRA)
    matmul_active: int  # active params used in a matmul per token, excluding embedding and lm_head


def count_parameters(arch: Arch, lora_rank: int | None = None, lora_targets: str = "attention") -> ParamCount:
    """Count parameters from the architecture. LoRA adds r * (in + out) per targeted
    linear: 'attention' = every token-mixer projection (attention q/k/v/o, GDN in/out
    projections, MLA q/kv/o projections; not the DSA indexer); 'all-linear' adds the
    dense-MLP and shared-expert projections (never routed experts, routers or lm_head)."""
    linear = other = lora = inactive = 0
    for layer in arch.layers:
        groups = _linears(arch, layer)
        for name, shapes in groups.items():
            size = sum(a * b for a, b in shapes)
            if name == "experts":
                linear += arch.experts * size
                inactive += (arch.experts - arch.experts_per_token) * size
            else:
                linear += size
            targeted = name == "mixer" or (name == "mlp" and lora_targets == "all-linear")
            if lora_rank and targeted:
                lora += sum(lora_rank * (a + b) for a, b in shapes)
        other += _other_params(arch, layer)
    other += arch.hidden  # final norm
    emb = arch.vocab * arch.hidden
    head = 0 if arch.tie_embeddings else emb
    total = emb + head + linear + other
    return ParamCount(total=total, active=total - inactive, embedding=emb, lm_head=head, linear=linear,
                      other=other, lora=lora, matmul_active=linear + other - inactive)


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

    shard_params: bool = False
    """Shard weights, gradients and optimizer state 1/W over the ranks (FSDP / ZeRO-3
    style; two layers' weights gathered at a time) instead of replicating them."""

    offload_state: bool = False
    """Keep the prompt state (and its gradient) in host memory and stage two layers at a
    time to the GPU (the paper's GLM-5.2 run)."""

    score_passes: int = 0
    """No-grad forwards of each branch before its replay, to score old / reference
    log-probs (`Engine.score`). The paper's recipe: 2 (old + reference). On-policy with
    beta = 0: 0. Adds time, and a (small) no-grad working set."""

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
        if self.mode not in ("detached", "exact"):
            raise ConfigError(f"PlanConfig.mode must be 'detached' or 'exact', got {self.mode!r}")
        if self.lora_targets not in LORA_TARGETS:
            raise ConfigError(f"PlanConfig.lora_targets must be one of {LORA_TARGETS}, got {self.lora_targets!r}")
        if self.self_attention not in SELF_ATTENTION:
            raise ConfigError(f"PlanConfig.self_attention must be one of {SELF_ATTENTION}, got {self.self_attention!r}")
        if not (isinstance(self.throughput_tflops, (int, float)) and math.isfinite(self.throughput_tflops)
                and self.throughput_tflops > 0):
            raise ConfigError(f"PlanConfig.throughput_tflops must be a number > 0, got {self.throughput_tflops!r}")
        self.gpu_memory = parse_bytes(self.gpu_memory)
        self.reserve = parse_bytes(self.reserve)
        if self.dtype is not None:
            self.dtype = _canonical_dtype(self.dtype)
        if self.weight_dtype is not None:
            self.weight_dtype = _canonical_dtype(self.weight_dtype, allow_quant=True)
            if self.weight_dtype in QUANT_BYTES and not self.lora_rank:
                raise ConfigError(f"weight_dtype {self.weight_dtype!r} stores frozen base weights: "
                                  "full training needs a float dtype; pass lora_rank for (Q)LoRA")


def _state_sizes(arch: Arch, b: int, rb: int, prompt: int, layers=None) -> dict:
    """Per-token and constant state bytes by kind, over `layers` (default: all).
    b: state dtype bytes; rb: recurrent state bytes."""
    s = {"attention_kv_per_token": 0, "mla_latent_per_token": 0, "indexer_keys_per_token": 0,
         "window_kv_fixed": 0, "recurrent_fixed": 0, "conv_tail_fixed": 0}
    kv = arch.kv_heads * 2 * arch.head_dim * b  # K and V per position
    for layer in arch.layers if layers is None else layers:
        if layer.mixer == "attention":
            if layer.window is None:
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


def _layer_state_bytes(arch: Arch, layer: LayerSpec, b: int, rb: int, positions: int) -> int:
    """State bytes of one layer holding `positions` positions."""
    s = _state_sizes(arch, b, rb, positions, [layer])
    return s["per_token"] * positions + s["fixed"]


def _graph_bytes_per_token(arch: Arch, layer: LayerSpec, ab: int) -> float:
    """Activation bytes one token leaves in the autograd graph of one layer.

    Element counts (each x ab bytes): an RMSNorm keeps ~3 x its width (input, fp32
    intermediate, output), two per layer; projections keep their outputs; SwiGLU keeps
    gate, up, act and act*up (4 x width). Calibrated on tiny-qwen3 against HF's saved
    tensors (5,376 vs 5,388 elements per token per layer, fp32).
    """
    h, H = arch.hidden, arch.heads
    e = 6 * h
    extra = 0.0
    if layer.mixer == "attention":
        qk_copies = 3 if arch.qk_norm else 2  # projection, (norm), rope
        e += qk_copies * (H + arch.kv_heads) * arch.head_dim + arch.kv_heads * arch.head_dim + H * arch.head_dim
        e += 3 * H * arch.head_dim if arch.attn_gate else 0  # gate half, sigmoid, gated product
    elif layer.mixer == "gdn":
        kd, vd = arch.gdn_k_heads * arch.gdn_k_dim, arch.gdn_v_heads * arch.gdn_v_dim
        # projections + conv in/out/act, l2-normed q/k, gated norm, decay / beta
        e += 4 * arch.conv_dim + 4 * kd + 6 * vd + 4 * arch.gdn_v_heads
        extra = arch.gdn_v_heads * arch.gdn_k_dim * arch.gdn_v_dim * 4 / GDN_CHUNK  # chunk states, fp32
    else:  # absorbed MLA: q latent per head, latent output per head
        H, kl, r = arch.heads, arch.kv_lora_rank, arch.rope_dim
        e += 4 * (arch.q_lora_rank or 0) + H * (arch.nope_dim + r) + H * (kl + r) + 4 * (kl + r) + H * kl
        e += H * arch.v_head_dim
    if layer.mlp == "dense":
        e += 4 * arch.intermediate
    else:
        e += 2 * arch.experts + arch.experts_per_token * (4 * arch.moe_intermediate + 2 * h)
        e += 4 * arch.shared_intermediate
    return e * ab + extra


def _attention_working(arch: Arch, layer: LayerSpec, queries: int, keys: int, block: int, acc: int, *,
                       backward: bool, fused: bool = False) -> float:
    """Transient bytes of the attention of `queries` rows over `keys` held positions in
    one layer. Blockwise torch path: scores and probabilities of one block (backward adds
    dprobs, dscores) in the accumulation dtype, the upcast K/V block, and q / out / dq in
    the accumulation dtype. `fused`: a flash kernel, only the q / out / lse rows."""
    if layer.mixer == "gdn" or keys == 0:
        return 0.0
    tiles = 4 if backward else 2
    if layer.mixer == "attention":
        d = 2 * arch.head_dim
        rows = 3 * arch.heads * queries * d / 2 * acc
        if fused:
            return rows
        B = min(block, keys, layer.window or keys)
        return tiles * arch.heads * queries * B * acc + arch.kv_heads * B * d * acc + rows
    kl, r = arch.kv_lora_rank, arch.rope_dim
    rows = 3 * arch.heads * queries * (kl + r) * acc
    B = min(block, keys, arch.index_topk if layer.sparse else keys)
    w = rows if fused else tiles * arch.heads * queries * B * acc + B * (kl + r) * acc + rows
    if layer.sparse:  # DSA selection: blockwise indexer scores + running top-k (value fp32 + index int64)
        w += (arch.index_heads + 1) * queries * min(block, keys) * acc + queries * min(arch.index_topk, keys) * 12
    return w


def _self_scores(arch: Arch, layer: LayerSpec, t: int, acc: int) -> float:
    """Dense self part of attention: [heads, T, T] scores + probs kept for backward."""
    if layer.mixer == "gdn":
        return 0.0
    return 2 * arch.heads * t * min(t, layer.window or t) * acc


def _autograd_pass(arch: Arch, tokens: int, keys: int, block: int, b: int, acc: int, dense_self: bool):
    """(graph bytes, largest transient) of `tokens` queries run with autograd through all
    layers against `keys` held positions: the per-token graph, plus the dense self part's
    [heads, T, T] scores + probs per attention layer; the transient is one layer's
    blockwise-attention backward (or the dense self part's backward)."""
    graph = tokens * (sum(_graph_bytes_per_token(arch, l, b) for l in arch.layers) + 3 * arch.hidden * b)
    attn = max(_attention_working(arch, l, tokens, keys, block, acc, backward=True) for l in arch.layers)
    if dense_self:
        graph += sum(_self_scores(arch, l, tokens, acc) for l in arch.layers)
        attn = max(attn, max(_self_scores(arch, l, tokens, acc) for l in arch.layers))
    return graph, attn


def _live_elements_per_token(arch: Arch, layer: LayerSpec) -> float:
    """Largest no-grad transient of one layer per token (elements): the residual stream
    and its norm, plus the wider of the mixer's projections and the MLP's gate/up/act."""
    h = arch.hidden
    if layer.mixer == "attention":
        mix = (2 * arch.heads + 2 * arch.kv_heads) * arch.head_dim * (2 if arch.attn_gate else 1)
    elif layer.mixer == "gdn":
        mix = 3 * arch.conv_dim + 3 * arch.gdn_v_heads * arch.gdn_v_dim
    else:
        mix = arch.heads * (arch.nope_dim + 2 * arch.rope_dim + 2 * arch.kv_lora_rank + arch.v_head_dim)
    if layer.mlp == "dense":
        mlp = 3 * arch.intermediate
    else:
        mlp = arch.experts + arch.experts_per_token * (3 * arch.moe_intermediate + h) + 3 * arch.shared_intermediate
    return 3 * h + max(mix, mlp)


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


def _forward_flops(arch: Arch, params: ParamCount, n_q: int, prefix: int, lm_head: bool) -> float:
    f = 2 * params.matmul_active * n_q + (2 * arch.vocab * arch.hidden * n_q if lm_head else 0)
    return f + sum(_mixer_flops(arch, layer, n_q, prefix) for layer in arch.layers)


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
    assumptions = []

    # ---- state
    st = _state_sizes(arch, b, rb, P)
    p_rank = math.ceil(P / W)
    state_total = st["per_token"] * P + st["fixed"]
    state_rank = st["per_token"] * p_rank + st["fixed"]
    exact = c.mode == "exact"
    n_chunks_rank = math.ceil(p_rank / c.chunk_size)
    checkpoints = n_chunks_rank * (st["recurrent_fixed"] + st["conv_tail_fixed"]) if exact else 0
    state_grad = state_rank if exact else 0
    state_gpu, state_host = state_rank, 0
    if c.offload_state:
        biggest = max(_layer_state_bytes(arch, l, b, rb, p_rank) for l in arch.layers)
        state_gpu = 2 * biggest * (2 if exact else 1)
        state_host = state_rank + state_grad + checkpoints
        state_grad = checkpoints = 0
        assumptions.append("offload_state: the state (and in exact mode its gradient and the chunk-start recurrent "
                           "checkpoints) lives in host memory; two layers' worth is staged on the GPU at a time")

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
    C = min(c.chunk_size, p_rank)  # capture / recompute chunk on one rank
    graph_tok = sum(_graph_bytes_per_token(arch, l, b) for l in arch.layers) + 3 * arch.hidden * b
    dense_grad = c.self_attention != "flash"  # self part of autograd passes (replay, recompute)
    fused_nograd = c.self_attention != "dense"  # capture through a fused kernel
    blk = c.attention_block_size
    # under CP a rank's queries read its own shard of the prompt (plus the branch's held pieces)
    replay_graph, replay_attn = _autograd_pass(arch, T, p_rank + held, blk, b, acc, dense_grad)
    logits = min(T, c.logits_chunk_size) * arch.vocab * (b + 3 * 4) + T * arch.hidden * b
    # the earlier pieces' state (and the recurrent state at each piece start), with grad buffers
    branch_state = 2 * (st["per_token"] * held + held // T * (st["recurrent_fixed"] + st["conv_tail_fixed"]))
    replay_working = replay_graph + max(replay_attn, logits) + branch_state
    capture_live = C * max(_live_elements_per_token(arch, l) for l in arch.layers) * b
    capture_attn = max(_attention_working(arch, l, C, p_rank, blk, acc, backward=False, fused=fused_nograd)
                       + (0 if fused_nograd else _self_scores(arch, l, C, acc)) for l in arch.layers)
    capture_working = capture_live + capture_attn
    recompute_working = sum(_autograd_pass(arch, C, p_rank, blk, b, acc, dense_grad)) if exact else 0.0
    score_working = 0.0
    if c.score_passes:  # one whole branch without autograd; fp32 logits + log-softmax of one chunk
        score_working = (R * max(_live_elements_per_token(arch, l) for l in arch.layers) * b
                         + max(_attention_working(arch, l, R, p_rank, blk, acc, backward=False, fused=fused_nograd)
                               + (0 if fused_nograd else _self_scores(arch, l, R, acc)) for l in arch.layers)
                         + min(R, c.logits_chunk_size) * arch.vocab * (b + 2 * 4))
    static = param_bytes + grad_bytes + optimizer_bytes + gathered + state_gpu + state_grad + checkpoints
    phases = {"capture": capture_working, "replay": replay_working}
    if exact:
        phases["recompute"] = recompute_working
    if c.score_passes:
        phases["score"] = score_working
    peak_phase = max(phases, key=phases.get)
    peak = static + phases[peak_phase]
    fits = peak + c.reserve <= c.gpu_memory

    # ---- time
    thr = c.throughput_tflops * 1e12
    flops_capture = _forward_flops(arch, params, P, 0, lm_head=False)
    branch_fwd = _forward_flops(arch, params, R, P, lm_head=True)
    held_fwd = _forward_flops(arch, params, held, P, lm_head=False) if held else 0.0
    flops_branch = (1 + BACKWARD_FACTOR + c.score_passes) * branch_fwd + held_fwd
    flops_exact_extra = (1 + BACKWARD_FACTOR) * flops_capture
    t_detached = (flops_capture + G * flops_branch) / W / thr
    t_exact = t_detached + flops_exact_extra / W / thr

    assumptions += [
        f"state counted for all P = {P:,} prompt positions (capture keeps P - 1); per-token state sharded "
        f"1/W = {p_rank:,} positions per rank, constant (recurrent / window) state replicated",
        f"state in {dtype}; GDN recurrent state in {'fp64' if rb == 8 else 'fp32'}",
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
        "held tokens), exact adds x(1 + backward) of the prompt forward",
        f"time = FLOPs / W / {c.throughput_tflops:g} TFLOP/s effective per rank (perfect CP scaling assumed)",
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
        "score_working_bytes": int(score_working),
        "static_bytes_per_rank": int(static),
        "peak_bytes_per_rank": int(peak),
        "peak_phase": peak_phase,
        "gpu_memory_bytes": c.gpu_memory,
        "reserve_bytes": c.reserve,
        "fits": bool(fits),
        "flops_capture": flops_capture,
        "flops_replay_per_branch": flops_branch,
        "flops_exact_extra": flops_exact_extra,
        "estimated_time_s_detached": t_detached,
        "estimated_time_s_exact": t_exact,
        "estimated_time_s": t_exact if exact else t_detached,
        "breakdown": {
            "state": {k: v for k, v in st.items() if k not in ("per_token", "fixed")},
            "replay": {"piece_tokens": T, "held_branch_tokens": held, "graph_bytes_per_token": graph_tok,
                       "graph_bytes": replay_graph, "attention_working_bytes": replay_attn,
                       "logits_working_bytes": logits, "branch_state_bytes": branch_state},
            "capture": {"chunk_tokens": C, "live_bytes": capture_live, "attention_working_bytes": capture_attn},
            "time_s": {"capture": flops_capture / W / thr, "replay_per_branch": flops_branch / W / thr,
                       "exact_extra": flops_exact_extra / W / thr},
        },
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
        ("state per rank", hb(r["state_bytes_per_rank"]) + (" (in host memory)" if i["offload_state"] else "")),
        None,
        ("weights per rank", hb(r["param_bytes"])),
        ("gradients per rank", hb(r["grad_bytes"])),
        ("optimizer per rank", hb(r["optimizer_bytes"])),
    ]
    if r["mode"] == "exact":
        rows += [("state gradient per rank", hb(r["state_grad_bytes_per_rank"])),
                 ("recurrent checkpoints per rank", hb(r["exact_checkpoint_bytes_per_rank"]))]
    rows += [
        ("working: capture (1 chunk)", hb(r["capture_working_bytes"])),
        ("working: replay (1 branch)", hb(r["replay_working_bytes"])),
    ]
    if r["mode"] == "exact":
        rows.append(("working: recompute (1 chunk)", hb(r["recompute_working_bytes"])))
    rows += [
        ("static per rank", hb(r["static_bytes_per_rank"])),
        ("PEAK per rank", f"{hb(r['peak_bytes_per_rank'])}  (during {r['peak_phase']})"),
        ("fits", f"{'yes' if r['fits'] else 'NO'}  (peak + {hb(r['reserve_bytes'])} reserve vs "
                 f"{hb(r['gpu_memory_bytes'])})"),
        None,
        ("time, detached", f"{r['estimated_time_s_detached']:,.1f} s"),
        ("time, exact", f"{r['estimated_time_s_exact']:,.1f} s"),
        ("  at", f"{i['throughput_tflops']:g} TFLOP/s effective per rank x {i['gpus']} rank(s)"),
    ]
    width = max(len(row[0]) for row in rows if row)
    lines = [f"  {row[0]:<{width}}  {row[1]}" if row else "" for row in rows]
    lines += ["", "  assumptions:"] + [f"    - {a}" for a in r["assumptions"]]
    return "\n".join(lines)
