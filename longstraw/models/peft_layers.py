"""Which PEFT adapters LongStraw runs exactly, and the affine map of one on a Linear.

LongStraw runs a prompt in chunks and each branch on its own, calling the model's own
(wrapped) modules. That equals Hugging Face's one-pass forward only when every adapter
layer maps each token by itself: no mean over the sequence (LiLy's router), no
dependence on the position (aLoRA) or on noise (PVeRA, MonteCLoRA when sampling), no
task ids (Poly), no virtual tokens that PEFT's own forward adds (prompt learning).
`check_peft` refuses every PEFT module whose tuner is not in `PER_TOKEN_TUNERS` (so
also mixed-type models and adaption prompts, which are untested here), each
tested against HF (tests/models/test_peft_layers.py); add one only with such a test.

Absorbed MLA (`mla.py`) multiplies by kv_b_proj's weight matrix instead of calling
the module, so an adapter there must also be an affine map of the token
(`AFFINE_TUNERS`), and `effective_affine` turns it into (weight [out, in], bias [out]):

* a plain `nn.Linear`: its weight and bias;
* plain LoRA (no variant, no `lora_bias`): base weight + each active adapter's
  `get_delta_weight` (one [out, r] @ [r, in] product per adapter);
* any other adapter in `AFFINE_TUNERS` (DoRA, `lora_bias`, LoHa, LoKr, IA3, OFT, BOFT,
  VeRA, FourierFT, ...): its own forward is probed on the rows of [0; I], which gives
  bias = f(0) and weight^T = f(I) - f(0) exactly as the adapter computes them,
  differentiably (one [in + 1, in] batch through the layer: as costly as its weight).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError

AFFINE_TUNERS = frozenset({
    "lora", "adalora", "beft", "boft", "deft", "delora", "fourierft", "frod", "glora", "hira",
    "hra", "ia3", "loha", "lokr", "miss", "osf", "peanut", "randlora", "road", "shira", "supertuning",
    "tinylora", "unilora", "vblora", "vera", "waveft",
})
"""PEFT tuner packages (`peft.tuners.<name>`) whose Linear layer is, in eval mode, an
affine map of each token alone (dropout is refused in train mode)."""

PER_TOKEN_TUNERS = AFFINE_TUNERS | {"c3a", "gralora", "ln_tuning", "oft", "trainable_tokens"}
"""Tuners whose layers map each token by itself (so chunking cannot change them). On
kv_b_proj, C3A's gradient differs from HF's and HF's own forward fails with OFT and
GraLoRA there, so those three are refused on kv_b_proj only."""

LORA_VARIANTS = frozenset({"DoraLinearVariant"})
"""LoRA variants (`lora_variant[adapter]`) that keep the layer per token (and affine)."""

_SHARED_PARTS = frozenset({"_buffer_dict", "tuners_utils", "lycoris_utils"})  # containers and base classes

_SUPPORTED = (f"LongStraw runs the PEFT types {sorted(PER_TOKEN_TUNERS)} (LoRA plain, with DoRA or lora_bias); "
              "use one of them, or leave this module out of target_modules")


def tuner_of(module: nn.Module) -> str | None:
    """The PEFT tuner package that defines `module`'s class ("lora", "loha", ...: its
    adapter layers, their parts and the tuner model), or None outside PEFT's tuners."""
    name = type(module).__module__
    if not name.startswith("peft.tuners."):
        return None
    tuner = name.split(".")[2]
    return None if tuner in _SHARED_PARTS else tuner


def _active(linear) -> list[str]:
    """The adapters that take part in `linear`'s forward (none when merged or disabled)."""
    if getattr(linear, "merged", False) or getattr(linear, "disable_adapters", False):
        return []
    return list(getattr(linear, "active_adapters", []))


def _active_variants(layer) -> list:
    """(adapter, LoRA variant) for the active adapters of `layer` that have one."""
    variants = getattr(layer, "lora_variant", None) or {}
    return [(name, variants[name]) for name in _active(layer) if name in variants]


def check_peft(model: nn.Module) -> None:
    """Refuse a PEFT model LongStraw would run differently from its own forward."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        raise UnsupportedModelError(
            f"the PEFT model's active adapter is {type(config).__name__} (prompt learning): its virtual tokens are "
            "added by PeftModel.forward, which LongStraw does not call, so they would be silently dropped; use an "
            f"adapter on the model's modules instead. {_SUPPORTED}")
    for name, module in model.named_modules():
        tuner = tuner_of(module)
        if tuner is None:
            continue
        if tuner not in PER_TOKEN_TUNERS:
            raise UnsupportedModelError(
                f"{name}: a PEFT {type(module).__name__} ({tuner}) wraps it, which does not map each token by itself "
                f"(chunked capture and replay would change its output). {_SUPPORTED}")
        for adapter, variant in _active_variants(module):
            if type(variant).__name__ not in LORA_VARIANTS:
                raise UnsupportedModelError(
                    f"{name}: LoRA adapter {adapter!r} is a {type(variant).__name__}, whose output depends on more "
                    f"than the token (its position, a router or noise). {_SUPPORTED}")


def is_plain_lora(linear) -> bool:
    """A LoRA Linear whose active adapters are all plain: W + sum of B A, no bias."""
    if tuner_of(linear) != "lora" or not isinstance(linear.base_layer, nn.Linear):
        return False
    variants = getattr(linear, "lora_variant", {})
    for name in _active(linear):
        if name in variants or name not in linear.lora_A:
            return False
        if getattr(linear.lora_B[name], "bias", None) is not None:  # lora_bias
            return False
    return True


def check_affine(linear: nn.Module, where: str) -> None:
    """Refuse a module on which `effective_affine` cannot reproduce the map."""
    tuner = tuner_of(linear)
    if tuner is None:
        if not isinstance(linear, nn.Linear):
            raise UnsupportedModelError(f"{where} is a {type(linear).__name__}, not an nn.Linear; absorbed MLA "
                                        "multiplies by its weight matrix")
        return
    fix = (f"absorbed MLA multiplies by its weight matrix, so there LongStraw runs the PEFT types "
           f"{sorted(AFFINE_TUNERS)} (LoRA plain, with DoRA or lora_bias); use one of them, or leave {where} out "
           "of target_modules")
    if tuner not in AFFINE_TUNERS:
        raise UnsupportedModelError(f"{where}: a PEFT {type(linear).__name__} ({tuner}) wraps it; {fix}")
    base = getattr(linear, "base_layer", None)
    if not isinstance(base, nn.Linear) or tuner_of(base) is not None:
        raise UnsupportedModelError(f"{where}: the PEFT layer wraps a {type(base).__name__}, not a plain nn.Linear "
                                    f"(stacked adapters?); {fix}")
    for adapter, variant in _active_variants(linear):
        if type(variant).__name__ not in LORA_VARIANTS:
            raise UnsupportedModelError(f"{where}: LoRA adapter {adapter!r} is a {type(variant).__name__}; {fix}")


def effective_affine(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias [out] or None) with `linear(x) == x @ weight.T + bias`
    for every token x, as its own forward computes it, differentiably (see the module
    docstring; `check_affine` has refused what this cannot do)."""
    if tuner_of(linear) is None:
        return linear.weight, linear.bias
    if is_plain_lora(linear):
        weight = linear.base_layer.weight
        for name in _active(linear):
            weight = weight + linear.get_delta_weight(name)
        return weight, linear.base_layer.bias
    base = linear.base_layer.weight
    eye = torch.eye(base.shape[1], dtype=base.dtype, device=base.device)
    rows = linear(torch.cat([torch.zeros_like(eye[:1]), eye]))  # (1 + in, out): f(0), then f(e_i) = W[:, i] + b
    bias = rows[0]
    return (rows[1:] - bias).T, bias
