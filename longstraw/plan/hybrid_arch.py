"""Capacity planner, architecture side, for the recurrent hybrids of the second model
round: Mamba2 hybrids (Nemotron-H, Granite 4.0, Bamba, Falcon-H1) and Kimi Linear
(KDA + MLA). Torch-free; `arch.architecture` calls in here.

Both recurrent kinds are the planner's "gdn" layer (`arch.LayerSpec`): a state constant
in P, [gdn_v_heads, gdn_k_dim, gdn_v_dim] in fp32, plus a conv tail [conv_dim, K-1] in
the model dtype, which is exactly what `models/mamba2.py` and `models/kimi_linear.py`
keep in their `RecurrentState`:

    Mamba2  SSM state [H, P, N]: gdn_v_heads = H, gdn_v_dim = P (head dim), gdn_k_dim = N
            (d_state), gdn_k_heads = G (n_groups): conv_dim = H P + 2 G N
    KDA     recurrent state [H, D, D]: gdn_k_heads = gdn_v_heads = H, Dk = Dv = D:
            conv_dim = 3 H D (one conv over [q | k | v])

Only the parameter counts differ from GDN's (`recurrent_linears`,
`recurrent_other_params`); working-set and FLOP estimates use the GDN formulas with
these geometries.
"""

from __future__ import annotations

from ..errors import ConfigError
from . import arch as _arch
from .arch import MAMBA2_TYPES, Arch, LayerSpec, cfg_get, cfg_need, mla_layers

# Nemotron-H's hybrid_override_pattern letters, and its layers_block_type names
_NEMOTRON_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_MAMBA_NAMES, _ATTENTION_NAMES = ("mamba", "linear_attention"), ("attention", "full_attention")  # HF spells both


def _mamba2_geometry(arch: Arch, cfg: dict, heads: str, head_dim: str, state: str, groups: str, conv: str,
                     width: int | None = None) -> None:
    """Set the Mamba2 fields of `arch` from the config's field names; `width` the SSM
    intermediate size (H * P) when the config gives it (Falcon-H1's mamba_d_ssm)."""
    cfg_need(cfg, heads, state)
    arch.recurrent = "mamba2"
    arch.gdn_v_heads = int(cfg[heads])
    expand = int(cfg_get(cfg, "mamba_expand", cfg_get(cfg, "expand", 2)))
    width = width or expand * arch.hidden
    p = cfg.get(head_dim)
    arch.gdn_v_dim = width // arch.gdn_v_heads if p in (None, "auto") else int(p)
    arch.gdn_k_dim, arch.gdn_k_heads = int(cfg[state]), int(cfg_get(cfg, groups, 1))
    arch.gdn_kernel = int(cfg_get(cfg, conv, 4))


def _nemotron_specs(arch: Arch, cfg: dict, n: int) -> list[LayerSpec]:
    """Nemotron-H's blocks (one mixer or one MLP / MoE each) as specs: an MLP block merges
    into the mixer block before it; a mixer block with none after it has mlp "none"."""
    blocks = cfg.get("layers_block_type")
    if blocks is None:
        pattern = cfg.get("hybrid_override_pattern")
        if pattern is None:
            raise ConfigError("nemotron_h config lacks hybrid_override_pattern (or layers_block_type)")
        blocks = [_NEMOTRON_BLOCKS[ch] for ch in pattern]
    if len(blocks) != n:
        raise ConfigError(f"nemotron_h has {len(blocks)} blocks in its pattern but num_hidden_layers is {n}")
    specs: list[LayerSpec] = []
    for i, block in enumerate(blocks):
        if block in _MAMBA_NAMES + _ATTENTION_NAMES:
            specs.append(LayerSpec("gdn" if block in _MAMBA_NAMES else "attention", mlp="none"))
        elif not specs or specs[-1].mlp != "none":
            raise ConfigError(f"nemotron_h block {i} ({block}) follows no mixer block: the planner merges each "
                              "MLP / MoE block into the mixer block before it")
        else:
            specs[-1].mlp = "dense" if block == "mlp" else "moe"
    return specs


def mamba2_layers(arch: Arch, cfg: dict, n: int) -> None:
    """nemotron_h / granitemoehybrid / bamba / falcon_h1: Mamba2 mixers and attention."""
    mt = arch.model_type
    if mt == "nemotron_h":
        _mamba2_geometry(arch, cfg, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel")
        arch.gated_mlp = False  # relu2: up, down (the experts too)
        bias = bool(cfg_get(cfg, "use_bias", False))  # HF's NemotronHMamba2Mixer: in_proj / out_proj bias=use_bias
        arch.mamba_biases = (bias, bias, bool(cfg_get(cfg, "use_conv_bias", True)))
        arch.experts = int(cfg_get(cfg, "n_routed_experts", 0))
        arch.experts_per_token = int(cfg_get(cfg, "num_experts_per_tok", 0))
        arch.moe_intermediate = int(cfg_get(cfg, "moe_intermediate_size", 0))
        shared = int(cfg_get(cfg, "n_shared_experts", 0))
        arch.shared_intermediate = int(cfg_get(cfg, "moe_shared_expert_intermediate_size", 0)) if shared else 0
        arch.layers = _nemotron_specs(arch, cfg, n)
        return
    width = cfg.get("mamba_d_ssm") if mt == "falcon_h1" else None
    _mamba2_geometry(arch, cfg, "mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
                     int(width) if width else None)
    bias = bool(cfg_get(cfg, "mamba_proj_bias", False))
    out_bias = bool(cfg_get(cfg, "projectors_bias", False)) if mt == "falcon_h1" else bias
    arch.mamba_biases = (bias, out_bias, bool(cfg_get(cfg, "mamba_conv_bias", True)))
    if mt == "falcon_h1":  # attention and Mamba2 side by side in every layer, then the MLP
        arch.head_dim = int(cfg_get(cfg, "head_dim", arch.hidden // arch.heads))
        arch.mamba_norm = bool(cfg_get(cfg, "mamba_rms_norm", False))
        arch.layers = [spec for _ in range(n)
                       for spec in (LayerSpec("attention", mlp="none", parallel=True), LayerSpec("gdn"))]
        return
    if mt == "bamba":
        attention = set(cfg_get(cfg, "attn_layer_indices", []))
        types = ["attention" if i in attention else "mamba" for i in range(n)]
        mlps = ["dense"] * n
    else:  # granitemoehybrid: a MoE with a shared expert per layer (or the shared MLP alone)
        types = cfg_get(cfg, "layer_types", ["mamba"] * n)
        arch.experts = int(cfg_get(cfg, "num_local_experts", 0))
        arch.experts_per_token = int(cfg_get(cfg, "num_experts_per_tok", 0))
        arch.moe_intermediate = arch.intermediate
        arch.shared_intermediate = int(cfg_get(cfg, "shared_intermediate_size", 0))
        if not arch.experts:
            arch.intermediate = arch.shared_intermediate
        mlps = ["moe" if arch.experts else "dense"] * n
    arch.layers = [LayerSpec("gdn" if t in _MAMBA_NAMES else "attention", mlp=m) for t, m in zip(types, mlps)]


def kimi_linear_layers(arch: Arch, cfg: dict, n: int) -> None:
    """kimi_linear: KDA and NoPE MLA layers (`layer_types`, or the checkpoint's 1-indexed
    linear_attn_config lists), a dense MLP in the first `first_k_dense_replace` layers and
    MoE after (HF's KimiLinearConfig)."""
    linear = cfg.get("linear_attn_config") or {}
    arch.recurrent = "kda"
    heads = int(cfg_get(cfg, "linear_num_heads", linear.get("num_heads", 32)))
    dim = int(cfg_get(cfg, "linear_head_dim", linear.get("head_dim", 128)))
    arch.gdn_k_heads = arch.gdn_v_heads = heads
    arch.gdn_k_dim = arch.gdn_v_dim = dim
    arch.gdn_kernel = int(cfg_get(cfg, "linear_conv_kernel_dim", linear.get("short_conv_kernel_size", 4)))
    types = cfg.get("layer_types")
    if types is None and "full_attn_layers" in linear:
        full = set(linear["full_attn_layers"])
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    moe = {**cfg, "n_routed_experts": cfg_get(cfg, "num_experts", cfg.get("num_local_experts")),
           "num_experts_per_tok": cfg_get(cfg, "num_experts_per_token", cfg.get("num_experts_per_tok")),
           "n_shared_experts": cfg_get(cfg, "num_shared_experts", cfg.get("n_shared_experts")),
           "first_k_dense_replace": cfg_get(cfg, "first_k_dense_replace", 1)}
    mla_layers(arch, moe, n, arch.heads)  # MLA geometry, experts, dense / MoE schedule
    for spec, t in zip(arch.layers, types):
        spec.mixer = "gdn" if t == "linear_attention" else "mla"


def recurrent_linears(arch: Arch) -> list[tuple[int, int]]:
    """(in, out) of a KDA or Mamba2 mixer's linear layers."""
    h = arch.hidden
    if arch.recurrent == "kda":  # q, k, v, forget gate f_a / f_b, b, output gate g_a / g_b, o
        hd, d = arch.gdn_v_heads * arch.gdn_v_dim, arch.gdn_v_dim
        return [(h, hd)] * 3 + [(h, d), (d, hd), (h, arch.gdn_v_heads), (h, d), (d, hd), (hd, h)]
    inner = arch.gdn_v_heads * arch.gdn_v_dim  # Mamba2: in_proj -> [gate | xBC | dt], out_proj
    return [(h, inner + arch.conv_dim + arch.gdn_v_heads), (inner, h)]


PEFT_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
"""Model types on which PEFT refuses LoRA on any module named out_proj (or conv1d):
`peft.tuners.tuners_utils._check_lora_target_modules_mamba` (Mamba's fused kernels read
out_proj's weight). Bamba and Granite 4.0 are not among them."""


def recurrent_lora_linears(arch: Arch) -> list[tuple[int, int]]:
    """(in, out) of the linears of a KDA or Mamba2 mixer that LoRA adapts: every one, but
    Mamba2's out_proj where PEFT refuses it (`PEFT_MAMBA_TYPES`: Nemotron-H, Falcon-H1)."""
    shapes = recurrent_linears(arch)
    return shapes[:1] if arch.recurrent == "mamba2" and arch.model_type in PEFT_MAMBA_TYPES else shapes


def recurrent_other_params(arch: Arch) -> int:
    """A KDA or Mamba2 mixer's non-linear parameters: conv (+ bias), decays, norm."""
    if arch.recurrent == "kda":  # conv (no bias), dt_bias per channel, A_log per head, o_norm
        return arch.conv_dim * arch.gdn_kernel + arch.gdn_v_heads * arch.gdn_v_dim + arch.gdn_v_heads + arch.gdn_v_dim
    inner = arch.gdn_v_heads * arch.gdn_v_dim  # conv (+ bias), dt_bias, A_log, D, gated norm, projection biases
    in_bias, out_bias, conv_bias = arch.mamba_biases
    return (arch.conv_dim * (arch.gdn_kernel + conv_bias) + 3 * arch.gdn_v_heads + (inner if arch.mamba_norm else 0)
            + (inner + arch.conv_dim + arch.gdn_v_heads) * in_bias + arch.hidden * out_bias)


_arch.HYBRID_LAYERS.update({**{mt: mamba2_layers for mt in MAMBA2_TYPES}, "kimi_linear": kimi_linear_layers})
_arch.RECURRENT_PARAMS.update(linears=recurrent_linears, other=recurrent_other_params, adapted=recurrent_lora_linears)
