"""Capacity planner, architecture side: units, presets, model configs -> per-layer
specs (`Arch`), and parameter counts. See `longstraw/plan/__init__.py` for the whole."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, UnsupportedModelError
from .units import human_bytes, parse_bytes  # noqa: F401 (callers import them from here)

PRESETS_PATH = Path(__file__).with_name("presets.json")

_DENSE_ATTENTION = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo3", "gemma3_text", "qwen3_moe", "mixtral",
                    "glm4_moe", "minimax_m2", "gpt_oss")
"""Families whose layers are all GQA attention (full or sliding), with dense or MoE MLPs."""
MAMBA2_TYPES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")
"""Mamba2 hybrids: Mamba2 mixers (the "gdn" recurrent kind with `Arch.recurrent` "mamba2") and attention."""
SUPPORTED_MODEL_TYPES = _DENSE_ATTENTION[:4] + ("qwen3_5", "qwen3_5_moe", "qwen3_next", "glm_moe_dsa", "deepseek_v32",
                                                "deepseek_v3") + _DENSE_ATTENTION[4:] + MAMBA2_TYPES + ("kimi_linear",)
# nested text configs of the multimodal Qwen3.5 / Gemma 3 checkpoints
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "gemma3": "gemma3_text"}
# MoE of the dense-attention families: (experts field, expert width field or None for
# intermediate_size, shared-expert count field)
_MOE_FIELDS = {"qwen3_moe": (("num_experts", "num_local_experts"), "moe_intermediate_size", None),
               "mixtral": ("num_local_experts", None, None), "minimax_m2": ("num_local_experts", None, None),
               "gpt_oss": ("num_local_experts", None, None),
               "glm4_moe": ("n_routed_experts", "moe_intermediate_size", "n_shared_experts")}

HYBRID_LAYERS: dict = {}
"""model_type -> layer builder (arch, cfg, n) of the recurrent hybrids, and RECURRENT_PARAMS
"linears" / "other" / "adapted": their mixers' parameter counts and LoRA's linears (arch
-> ...). Filled by `plan/hybrid_arch.py`, which builds on this module."""
RECURRENT_PARAMS: dict = {}

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp64": "float64", "f64": "float64", "double": "float64", "fp32": "float32", "f32": "float32",
                  "float": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16"}
# Storage of quantized linear weights, bytes per parameter. NF4 with double quantization
# (QLoRA): 4 bits + 0.127 bits of block constants. FP8/INT8: 1 byte (scales ignored).
QUANT_BYTES = {"nf4": 4.127 / 8, "fp8": 1.0, "int8": 1.0}

NF4 = "nf4"
BACKWARD_FACTOR = 2.0  # backward FLOPs ~ 2x forward (input grads + weight grads)
GDN_CHUNK = 64  # chunked delta-rule kernels keep one [v_heads, dk, dv] fp32 state per 64 tokens
GDN_KERNELS = ("torch", "fla")  # ops/gated_delta.py's chunked torch path, or flash-linear-attention
# Working-set constants of LongStraw's DSA kernels; they mirror the defaults of
# ops/dsa.py (indexer_topk, sparse_latent_attention), which tests/test_plan.py checks.
INDEXER_QUERY_BLOCK = 128  # queries scored at once: a [128, N] score block over all N visible keys
INDEXER_KEY_BLOCK = 1024  # keys per indexer matmul: a [128, index_heads, 1024] temporary
SPARSE_QUERY_BLOCK = 64  # queries per gathered block of the sparse attention
# Bytes per (query, key) element of the exact top-k selection (ops/dsa.select_topk): the
# fp32 score, int32 running count, and the bool masks alive at once. Measured: 14.06 B
# (live tensors of indexer_topk at 4,096 queries over 16K vs 64K keys, tiny glm_moe_dsa).
TOPK_SELECT_BYTES = 14
LORA_TARGETS = ("attention", "all-linear")
SELF_ATTENTION = ("dense", "fused-nograd", "flash")


# ----------------------------------------------------------------------------
# units


def canonical_dtype(name: str, *, allow_quant: bool = False) -> str:
    key = str(name).lower().replace("torch.", "")
    key = _DTYPE_ALIASES.get(key, key)
    if key in DTYPE_BYTES or (allow_quant and key in QUANT_BYTES):
        return key
    have = sorted(DTYPE_BYTES) + (sorted(QUANT_BYTES) if allow_quant else [])
    raise ConfigError(f"unknown dtype {name!r}; use one of {have} (or bf16, fp16, fp32, fp64)")


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

    mixer: "attention" (GQA/MQA), "gdn" or "mla". "gdn" is any recurrent layer with
        a constant state [gdn_v_heads, gdn_k_dim, gdn_v_dim] and a conv tail [conv_dim,
        K-1]; `Arch.recurrent` says which: Gated DeltaNet, KDA (Kimi Linear: Hk = Hv = H,
        Dk = Dv) or Mamba2 (Hv = SSM heads, Dk = d_state, Dv = head dim, Hk = n_groups:
        conv_dim = 2 G N + H P as for GDN).
    window: sliding window W of an attention layer, or None.
    indexer: an MLA layer that runs its own DSA indexer (keeps indexer keys).
    sparse: an MLA layer whose attention reads only the DSA top-k keys.
    mlp: "dense", "moe" or "none" (a Nemotron-H mixer block with no MLP; an MLP block
        there is merged into the mixer block before it, and Falcon-H1's parallel layer is
        two specs: its attention with no MLP, then its Mamba2 mixer with the MLP).
    """

    mixer: str
    mlp: str = "dense"
    window: int | None = None
    indexer: bool = False
    sparse: bool = False
    parallel: bool = False  # runs beside the next spec on the same normed input (Falcon-H1's attention)


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
    expert_ranks: int = 1  # expert parallelism: the experts split over this many ranks (plan/experts.py)
    context_ranks: int = 1  # context parallelism: the prompt state sharded over this many ranks (working.py)
    lora: tuple | None = None  # (rank, targets) of LoRA: a frozen base keeps less (working.lora_graph_saving)
    # Gated DeltaNet
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_kernel: int = 0
    gdn_split_proj: bool = True  # Qwen3.5: in_proj_qkv/z/b/a; Qwen3-Next: in_proj_qkvz/ba
    recurrent: str = "gdn"  # the "gdn" layers' kind: "gdn", "kda" (Kimi Linear) or "mamba2"
    mamba_norm: bool = True  # Mamba2's gated RMSNorm (Falcon-H1 may have none)
    mamba_biases: tuple = (False, False, True)  # Mamba2's in_proj, out_proj and conv biases
    gated_mlp: bool = True  # SwiGLU (gate, up, down); Nemotron-H's relu2 MLPs and experts: up, down
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


def cfg_get(cfg: dict, name: str, default=None):
    value = cfg.get(name, default)
    return default if value is None else value


def cfg_need(cfg: dict, *names: str) -> None:
    missing = [n for n in names if cfg.get(n) is None]
    if missing:
        raise ConfigError(f"{cfg.get('model_type')} config lacks {missing}: the planner needs them")


def _text_config(config: dict) -> tuple[dict, str | None]:
    """(the text model's config, its dtype name or None): a multimodal wrapper (Qwen3.5)
    nests the text model under 'text_config'."""
    cfg = dict(config)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrapper (Qwen3.5): use the text model
        text = dict(cfg["text_config"])
        text.setdefault("model_type", cfg.get("model_type"))
        dtype = dtype or text.get("torch_dtype") or text.get("dtype")
        if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        cfg = text
    return cfg, dtype


def _moe_mlps(arch: Arch, cfg: dict, n: int) -> list[str]:
    """The MLP kind of each layer of a dense-attention family ("dense" or "moe")."""
    fields = _MOE_FIELDS.get(arch.model_type)
    if fields is None:
        return ["dense"] * n
    experts, width, shared = fields
    if isinstance(experts, tuple):  # aliases: a hub config.json's name, then transformers 5's `to_dict()` one
        experts = next((name for name in experts if cfg.get(name) is not None), experts[0])
    cfg_need(cfg, experts, "num_experts_per_tok", width or "intermediate_size")
    arch.experts, arch.experts_per_token = int(cfg[experts]), int(cfg["num_experts_per_tok"])
    arch.moe_intermediate = int(cfg[width or "intermediate_size"])
    arch.shared_intermediate = int(cfg_get(cfg, shared, 0)) * arch.moe_intermediate if shared else 0
    if arch.model_type == "glm4_moe":
        return ["dense" if i < int(cfg_get(cfg, "first_k_dense_replace", 0)) else "moe" for i in range(n)]
    step, dense_only = int(cfg_get(cfg, "decoder_sparse_step", 1)), set(cfg_get(cfg, "mlp_only_layers", []))
    return ["dense" if (i in dense_only or (i + 1) % step) else "moe" for i in range(n)]


def _attention_layers(arch: Arch, cfg: dict, n: int) -> None:
    """The dense-attention families (`_DENSE_ATTENTION`): full or sliding-window attention
    layers (by `layer_types`, or each family's own default schedule), dense or MoE MLPs.
    Attention sinks (gpt-oss: one logit per head) keep no state; parameter counts follow
    the llama layout (biases of gpt-oss's experts, fused projections: the same sizes)."""
    mt = arch.model_type
    arch.qk_norm = mt in ("qwen3", "qwen3_moe", "gemma3_text") or bool(cfg.get("use_qk_norm", False))
    arch.qkv_bias = mt == "qwen2" or bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if mt == "gemma3_text":  # transformers' Gemma3TextConfig schedule: 5 local : 1 global
            every = int(cfg_get(cfg, "sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        elif mt == "mistral":
            types = ["sliding_attention" if window else "full_attention"] * n
        elif mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
            first = int(cfg_get(cfg, "max_window_layers", n))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        else:
            types = ["full_attention"] * n
    mlps = _moe_mlps(arch, cfg, n)
    arch.layers = [LayerSpec("attention", mlp=m, window=int(window) if t == "sliding_attention" and window else None)
                   for t, m in zip(types, mlps)]


def _gdn_layers(arch: Arch, cfg: dict, n: int) -> None:
    """qwen3_5 / qwen3_5_moe / qwen3_next: Gated DeltaNet and gated attention layers, dense or MoE."""
    mt = arch.model_type
    cfg_need(cfg, "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim")
    arch.qk_norm, arch.attn_gate = True, True
    arch.gdn_k_heads, arch.gdn_v_heads = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    arch.gdn_k_dim, arch.gdn_v_dim = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
    arch.gdn_kernel = int(cfg_get(cfg, "linear_conv_kernel_dim", 4))
    arch.gdn_split_proj = mt != "qwen3_next"
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg_get(cfg, "full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if mt == "qwen3_5":
        mlps = ["dense"] * n
    else:
        cfg_need(cfg, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
        arch.experts, arch.experts_per_token = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
        arch.moe_intermediate = int(cfg["moe_intermediate_size"])
        arch.shared_intermediate = int(cfg_get(cfg, "shared_expert_intermediate_size", 0))
        arch.qwen_moe = True
        step, dense_only = int(cfg_get(cfg, "decoder_sparse_step", 1)), set(cfg_get(cfg, "mlp_only_layers", []))
        mlps = ["dense" if (i in dense_only or (i + 1) % step) else "moe" for i in range(n)]
    arch.layers = [LayerSpec("gdn" if t == "linear_attention" else "attention", mlp=m) for t, m in zip(types, mlps)]


def _dsa_indexers(arch: Arch, cfg: dict, n: int) -> list[bool]:
    """deepseek_v32 / glm_moe_dsa: which layers run their own DSA indexer (the others reuse
    an earlier layer's top-k)."""
    cfg_need(cfg, "index_n_heads", "index_head_dim", "index_topk")
    arch.index_heads, arch.index_dim = int(cfg["index_n_heads"]), int(cfg["index_head_dim"])
    arch.index_topk = int(cfg["index_topk"])
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = ([{"F": "full", "S": "shared"}[ch] for ch in pattern] if isinstance(pattern, str)
                 else list(pattern))
    if types is None and arch.model_type == "glm_moe_dsa":  # transformers' GlmMoeDsaConfig schedule
        freq = max(int(cfg_get(cfg, "index_topk_freq", 1)), 1)
        offset = int(cfg_get(cfg, "index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return [t == "full" for t in types] if types is not None else [True] * n


def mla_layers(arch: Arch, cfg: dict, n: int, heads: int) -> None:
    """deepseek_v3 / deepseek_v32 / glm_moe_dsa: MLA layers (with DSA), dense or MoE."""
    cfg_need(cfg, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    arch.q_lora_rank = cfg.get("q_lora_rank")
    arch.kv_lora_rank, arch.rope_dim = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    arch.nope_dim, arch.v_head_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
    arch.head_dim = arch.nope_dim + arch.rope_dim
    arch.kv_heads = heads
    arch.experts = int(cfg_get(cfg, "n_routed_experts", 0))
    arch.experts_per_token = int(cfg_get(cfg, "num_experts_per_tok", 0))
    arch.moe_intermediate = int(cfg_get(cfg, "moe_intermediate_size", 0))
    arch.shared_intermediate = int(cfg_get(cfg, "n_shared_experts", 0)) * arch.moe_intermediate
    mlps = cfg.get("mlp_layer_types")
    if mlps is None:
        k = min(int(cfg_get(cfg, "first_k_dense_replace", 0)), n)
        mlps = ["dense"] * k + ["sparse"] * (n - k)
    mlps = ["moe" if m == "sparse" and arch.experts else "dense" for m in mlps]
    dsa = arch.model_type in ("deepseek_v32", "glm_moe_dsa")
    indexer = _dsa_indexers(arch, cfg, n) if dsa else [False] * n
    arch.layers = [LayerSpec("mla", mlp=m, indexer=ix, sparse=dsa) for m, ix in zip(mlps, indexer)]


def architecture(config: dict) -> Arch:
    """Normalize an HF config dict of a supported family into an `Arch`."""
    cfg, dtype = _text_config(config)
    mt = _TEXT_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {cfg.get('model_type')!r} is not supported by the planner; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if mt == "nemotron_h" and cfg.get("num_hidden_layers") is None:  # HF derives it from the block pattern
        cfg["num_hidden_layers"] = len(cfg.get("layers_block_type") or cfg.get("hybrid_override_pattern") or "")
    cfg_need(cfg, "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    n, h, heads = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    arch = Arch(model_type=mt, layers=[], hidden=h, vocab=int(cfg["vocab_size"]),
                tie_embeddings=bool(cfg_get(cfg, "tie_word_embeddings", False)), heads=heads,
                kv_heads=int(cfg_get(cfg, "num_key_value_heads", heads)),
                head_dim=int(cfg_get(cfg, "head_dim", h // heads)),
                intermediate=int(cfg_get(cfg, "intermediate_size", 0)),
                max_positions=cfg.get("max_position_embeddings"),
                dtype=canonical_dtype(dtype) if dtype else None)
    if mt in _DENSE_ATTENTION:
        _attention_layers(arch, cfg, n)
    elif mt in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        _gdn_layers(arch, cfg, n)
    elif mt in HYBRID_LAYERS:  # Mamba2 hybrids, Kimi Linear
        HYBRID_LAYERS[mt](arch, cfg, n)
    else:  # MLA family: deepseek_v3, deepseek_v32, glm_moe_dsa
        mla_layers(arch, cfg, n, heads)
    if mt in ("nemotron_h", "falcon_h1"):
        pass  # blocks merged (Nemotron-H) or split (Falcon-H1) into specs: checked where read
    elif len(arch.layers) != n:
        raise ConfigError(f"layer_types has {len(arch.layers)} entries but num_hidden_layers is {n}")
    if any(l.mlp == "dense" for l in arch.layers) and not arch.intermediate:
        raise ConfigError(f"{mt} config lacks intermediate_size for its dense MLP layers")
    return arch


# ----------------------------------------------------------------------------
# parameters


def layer_linears(arch: Arch, layer: LayerSpec) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of each linear layer of one decoder layer, by group:
    'mixer' (attention / GDN / MLA projections), 'indexer', 'mlp' (dense or shared
    expert), 'experts' (routed experts: n x 3 linears)."""
    h = arch.hidden
    groups: dict[str, list[tuple[int, int]]] = {"mixer": [], "indexer": [], "mlp": [], "experts": []}
    if layer.mixer == "attention":
        q_out = arch.heads * arch.head_dim * (2 if arch.attn_gate else 1)
        kv = arch.kv_heads * arch.head_dim
        groups["mixer"] = [(h, q_out), (h, kv), (h, kv), (arch.heads * arch.head_dim, h)]
    elif layer.mixer == "gdn" and arch.recurrent != "gdn":
        groups["mixer"] = RECURRENT_PARAMS["linears"](arch)
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
    ins = 2 if arch.gated_mlp else 1  # gate and up, or up only
    if layer.mlp == "dense":
        groups["mlp"] = [(h, arch.intermediate)] * ins + [(arch.intermediate, h)]
    elif layer.mlp == "moe":
        if arch.shared_intermediate:
            groups["mlp"] = [(h, arch.shared_intermediate)] * ins + [(arch.shared_intermediate, h)]
        groups["experts"] = [(h, arch.moe_intermediate)] * ins + [(arch.moe_intermediate, h)]
    return groups


def layer_other_params(arch: Arch, layer: LayerSpec) -> int:
    """Non-linear parameters of one layer: norms, biases, conv, router, gates."""
    h = arch.hidden
    n = h * ((0 if layer.parallel else 1) + (layer.mlp != "none"))  # input + post-attention norm
    if layer.mixer == "attention":
        n += 2 * arch.head_dim if arch.qk_norm else 0
        n += (arch.heads + 2 * arch.kv_heads) * arch.head_dim if arch.qkv_bias else 0
    elif layer.mixer == "gdn" and arch.recurrent != "gdn":
        n += RECURRENT_PARAMS["other"](arch)
    elif layer.mixer == "gdn":
        n += arch.conv_dim * arch.gdn_kernel + 2 * arch.gdn_v_heads + arch.gdn_v_dim  # conv, A_log, dt_bias, norm
    else:
        n += (arch.q_lora_rank or 0) + arch.kv_lora_rank  # q_a / kv_a norms
        n += 2 * arch.index_dim if layer.indexer else 0  # indexer k_norm (LayerNorm)
    if layer.mlp == "moe":
        n += h * arch.experts + (h if arch.qwen_moe and arch.shared_intermediate else 0)  # router, shared gate
        # (DeepSeek / GLM's e_score_correction_bias is a buffer in HF, not a parameter)
    return n


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def indexer_parameters(arch: Arch) -> int:
    """Parameters of the DSA indexers (wq_b, wk, weights_proj, k_norm). The indexer runs
    without grad, so they never get a gradient."""
    return sum(sum(a * b for a, b in layer_linears(arch, layer)["indexer"]) + 2 * arch.index_dim
               for layer in arch.layers if layer.indexer)


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


def count_parameters(arch: Arch, lora_rank: int | None = None, lora_targets: str = "attention",
                     pad_to: int = 1) -> ParamCount:
    """Count parameters from the architecture. LoRA adds r * (in + out) per targeted
    linear: 'attention' = every token-mixer projection (attention q/k/v/o, GDN in/out
    projections, MLA q/kv/o projections; not the DSA indexer); 'all-linear' adds the
    dense-MLP and shared-expert projections (never routed experts, routers or lm_head);
    Mamba2's out_proj only where PEFT allows it (`hybrid_arch.recurrent_lora_linears`).
    `pad_to`: the adapters' first dimension rounded up to a multiple of it, as FSDP2 pads
    each parameter's shards over W ranks (A [r, in], B [out, r]; `lora` only)."""
    linear = other = lora = inactive = 0
    for layer in arch.layers:
        groups = layer_linears(arch, layer)
        for name, shapes in groups.items():
            size = sum(a * b for a, b in shapes)
            if name == "experts":
                linear += arch.experts * size
                inactive += (arch.experts - arch.experts_per_token) * size
            else:
                linear += size
            if lora_rank and (name == "mixer" or (name == "mlp" and lora_targets == "all-linear")):
                recurrent = name == "mixer" and layer.mixer == "gdn" and arch.recurrent != "gdn"
                lora += sum(_padded(lora_rank, pad_to) * a + _padded(b, pad_to) * lora_rank
                            for a, b in (RECURRENT_PARAMS["adapted"](arch) if recurrent else shapes))
        other += layer_other_params(arch, layer)
    other += arch.hidden  # final norm
    emb = arch.vocab * arch.hidden
    head = 0 if arch.tie_embeddings else emb
    total = emb + head + linear + other
    return ParamCount(total=total, active=total - inactive, embedding=emb, lm_head=head, linear=linear,
                      other=other, lora=lora, matmul_active=linear + other - inactive)
