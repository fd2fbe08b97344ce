"""The one seam between a loaded model and the torch-free planner: a Hugging Face model's
real shapes and dtypes in the planner's terms (`plan.arch.Arch`, byte counts).

The engine's default recompute rule (`defaults.recompute_pays`) and `fit_config` both
need figures the planner computes from a config alone (a piece's autograd graph per
token, the state per token); this module turns the model's own `config` into the dict
the planner reads and measures what the loaded model already holds (its weights and
the gradients of what it trains). plan/ never imports torch; this module is where
torch-side objects meet it.
"""

from __future__ import annotations

from longstraw.plan.arch import Arch, architecture
from longstraw.plan.kept_outputs import exact_state_bytes_per_token, kept_output_bytes_per_token
from longstraw.plan.working import graph_bytes_per_token as _layer_graph_bytes

__all__ = ["planner_config", "planner_arch", "graph_bytes_per_token", "model_held_bytes", "FALLBACK_GRAPH_HIDDENS",
           "kept_output_bytes_per_position"]

FALLBACK_GRAPH_HIDDENS = 16
"""A family the planner does not model: graph bytes per token and layer taken as this
many hidden-size rows (q, k, v, attention output, two norms, the MLP's gate / up /
activation / down inputs at ~3x hidden: about 16), in the compute dtype."""


def _local(t):
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    return getattr(t, "_local_tensor", t)


def planner_config(model) -> dict:
    """The HF config of `model` (a `...ForCausalLM`, PEFT-wrapped or not) as the dict the
    planner reads (`plan.arch.architecture`): `config.to_dict()`, or a VLM's text config with
    its `vision_config`."""
    base = model
    for name in ("get_base_model",):  # PEFT
        if hasattr(base, name):
            base = getattr(base, name)()
    cfg = base.config.to_dict()
    if cfg.get("text_config"):  # a VLM: its text model, and its tower's shape for images (`plan/vision.py`)
        vision = {"vision_config": cfg["vision_config"]} if cfg.get("vision_config") else {}
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type")),
               **vision}
    return cfg


def planner_arch(model) -> Arch | None:
    """The planner's `Arch` of `model`, or None for a family the planner does not model."""
    try:
        return architecture(planner_config(model))
    except Exception:  # an unsupported model_type or a config the planner cannot read
        return None


def _compute_bytes(model) -> int:
    """Bytes of the model's compute dtype (its first floating parameter's)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def graph_bytes_per_token(model, layers: int, gdn_kernel: str = "torch") -> float:
    """Autograd graph bytes one token leaves in one pass over every decoder layer (plus
    the hidden rows), by the planner's per-layer model (`plan.working`) for the model's
    real shapes and compute dtype; `FALLBACK_GRAPH_HIDDENS` rows per layer for a family
    the planner does not model. `layers`: the model's decoder layers."""
    b = _compute_bytes(model)
    arch = planner_arch(model)
    if arch is None:
        hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
        return float(layers * FALLBACK_GRAPH_HIDDENS * hidden * b)
    return float(sum(_layer_graph_bytes(arch, layer, b, gdn_kernel) for layer in arch.layers) + 3 * arch.hidden * b)


def kept_output_bytes_per_position(model, prompt_tokens: int) -> tuple[float, float]:
    """(bytes `keep_attention_outputs` keeps, bytes exact mode's state holds with its
    gradients) per prompt position of a `prompt_tokens` prompt, by the planner's model
    (`plan.memory`) for the model's real shapes and compute dtype: the figures of the
    kept-outputs rule (`defaults.keeps_attention_outputs`). (0, 0) for a family the
    planner does not model (the rule then keeps none)."""
    arch = planner_arch(model)
    if arch is None:
        return 0.0, 0.0
    b = _compute_bytes(model)
    acc = 8 if b == 8 else 4  # attention / softmax and recurrent accumulation: fp32, fp64 under fp64
    return (kept_output_bytes_per_token(arch, b, acc, prompt_tokens),
            exact_state_bytes_per_token(arch, b, acc, acc, prompt_tokens))


def model_held_bytes(model) -> int:
    """Bytes the loaded model holds on this rank before a step: every parameter (a
    sharded one's local shard) and a gradient for each trainable one."""
    weights = grads = 0
    for p in model.parameters():
        local = _local(p)
        n = local.numel() * local.element_size()
        weights += n
        grads += n if p.requires_grad else 0
    return weights + grads
