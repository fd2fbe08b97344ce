"""LoRA in a rehearsal: the planner's adapters on the fake model, or a PEFT model's own.

`longstraw plan --lora-rank r --lora-targets T` plans LoRA of rank r on the linears
`plan.arch.count_parameters` counts: "attention", every token mixer's projection
(attention q/k/v/o, GDN in/out, MLA q/kv/o, KDA's and Mamba2's projections; not the DSA
indexer); "all-linear", also the dense MLPs' and the shared experts' projections (never
routed experts, routers, the shared-expert gate or lm_head). `target_modules` names the
same linears in a stock HF model, so a rehearsal wraps its fake model with exactly the
adapters the planner counts (tests/rehearsal/test_lora.py: equal adapter parameters for
every family), in the model's dtype (the planner's "adapters in the compute dtype";
PEFT's default `autocast_adapter_dtype` would make them float32), base weights frozen.

A stock PEFT model passed to `ls.rehearse` keeps its own adapters: `twin_adapters` reads
its adapter configs, the rehearsal applies them to its fake base, and `check_twin` holds
the twin to the model (every parameter's name and shape; dtype and `requires_grad` are
taken from the model's).
"""

from __future__ import annotations

import copy
from unittest import mock

import peft
from peft.utils import transformers_weight_conversion
from torch import nn

from longstraw.errors import ConfigError
from longstraw.models.base import unwrap_causal_lm
from longstraw.plan.hybrid_arch import PEFT_MAMBA_TYPES

LORA_TARGETS = ("attention", "all-linear")

MIXERS = ("self_attn", "linear_attn", "mamba", "attention", "mixer")
"""A decoder layer's child holding its token mixer (Nemotron-H's `mixer` only when its
`block_type` is not an MLP's)."""
MLPS = ("mlp", "feed_forward", "block_sparse_moe")
"""A decoder layer's child holding its MLP (or MoE block)."""
NOT_ADAPTED = frozenset({"indexer", "experts", "gate", "router", "shared_expert_gate"})
"""Path parts under which no linear is adapted: the DSA indexer, routed experts, routers."""
MLP_BLOCKS = ("mlp", "moe")


def check_lora(rank, targets) -> None:
    """`ConfigError` for a LoRA rank (None: no LoRA) or targets a rehearsal cannot build."""
    if targets not in LORA_TARGETS:
        raise ConfigError(f"rehearse: lora_targets must be one of {LORA_TARGETS}, got {targets!r}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ConfigError(f"rehearse: lora_rank must be a positive int, got {rank!r}")


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, module list) of `model`'s decoder layers."""
    causal = unwrap_causal_lm(model)
    backbone = causal.model
    if not hasattr(backbone, "layers") and hasattr(backbone, "language_model"):
        backbone = backbone.language_model
    for name, module in model.named_modules():
        if module is backbone.layers:
            return name, module
    raise ConfigError(f"rehearse: no decoder layers found in {type(model).__name__}")


def _role(layer: nn.Module, child: str) -> str | None:
    """'mixer', 'mlp' or None for `layer`'s child named `child`."""
    if child == "mixer":
        return "mlp" if getattr(layer, "block_type", None) in MLP_BLOCKS else "mixer"
    return "mixer" if child in MIXERS else "mlp" if child in MLPS else None


def target_modules(model: nn.Module, targets: str) -> list[str]:
    """Qualified names of the `nn.Linear`s the planner's LoRA of `targets` adapts in `model`."""
    prefix, layers = _decoder_layers(model)
    roles = ("mixer",) if targets == "attention" else ("mixer", "mlp")
    refused = {"out_proj"} if getattr(model.config, "model_type", None) in PEFT_MAMBA_TYPES else set()
    names = []
    for i, layer in enumerate(layers):
        for child, block in layer.named_children():
            if _role(layer, child) not in roles:
                continue
            for sub, module in block.named_modules():
                parts = set(sub.split("."))
                if isinstance(module, nn.Linear) and not NOT_ADAPTED & parts and sub.split(".")[-1] not in refused:
                    names.append(f"{prefix}.{i}.{child}.{sub}")
    if not names:
        raise ConfigError(f"rehearse: lora_targets={targets!r} finds no linear in {type(model).__name__}'s layers")
    return names


def with_lora(model: nn.Module, rank: int, targets: str) -> nn.Module:
    """`model` (meta) wrapped with PEFT LoRA of `rank` on `target_modules(model, targets)`,
    the adapters in the model's dtype, the base weights frozen.

    PEFT's conversion of v4 adapter configs (`convert_peft_config_for_transformers`) is
    skipped: on the MoE families transformers v5 fused (GLM-5, ...) it turns every target
    ending in gate_proj / up_proj / down_proj, the shared experts' too, into the routed
    experts' fused weights, which the planner does not adapt."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=target_modules(model, targets))
    with mock.patch.object(transformers_weight_conversion, "convert_peft_config_for_transformers",
                           lambda *args, **kwargs: None):
        return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


def twin_adapters(model: nn.Module) -> tuple[dict, str | list[str]] | None:
    """({adapter name: PEFT config}, active adapter(s)) of a PEFT model, else None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(model, peft.PeftModel) or not configs:
        return None
    return {name: copy.deepcopy(cfg) for name, cfg in configs.items()}, model.active_adapter


def with_adapters(model: nn.Module, adapters: tuple[dict, str | list[str]]) -> nn.Module:
    """`model` (meta) wrapped with the adapters `twin_adapters` read, the same ones active."""
    configs, active = adapters
    first = active if isinstance(active, str) else active[0]
    twin = peft.get_peft_model(model, copy.deepcopy(configs[first]), adapter_name=first,
                               autocast_adapter_dtype=False)
    for name, cfg in configs.items():
        if name != first:
            twin.add_adapter(name, copy.deepcopy(cfg))
    if isinstance(active, str):
        twin.set_adapter(active)
    else:  # several active at once (LoRA's `base_model.set_adapter` takes a list)
        twin.base_model.set_adapter(list(active))
    return twin


def like(model: nn.Module) -> dict[str, tuple]:
    """{parameter name: (shape, dtype, requires_grad)} of `model`, what its twin must match."""
    return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)}


def check_twin(twin: nn.Module, want: dict[str, tuple]) -> None:
    """`ConfigError` unless the fake twin has `want`'s parameters, by name and shape."""
    got = {n: tuple(p.shape) for n, p in twin.named_parameters(remove_duplicate=False)}
    missing = sorted(set(want) - set(got)) + sorted(set(got) - set(want))
    if missing:
        raise ConfigError(f"rehearse: the PEFT model's fake twin (its adapter configs applied to a model built from "
                          f"its config) differs in parameter {missing[0]!r}; pass the base model with lora_rank= "
                          "and lora_targets= instead")
    for name, (shape, _, _) in want.items():
        if got[name] != shape:
            raise ConfigError(f"rehearse: the PEFT model's fake twin has {name} of shape {got[name]}, the model "
                              f"{shape}; pass the base model with lora_rank= and lora_targets= instead")
