"""The planner's term for exact mode's `keep_attention_outputs`: the attention outputs and
log-sum-exps capture keeps per prompt position so the reverse walk runs attention's backward
without a second attention over the prompt, and the engine's rule that decides whether they
are kept (`defaults.keeps_attention_outputs`). Torch-free.

Legend as in `memory.py`: P prompt tokens; b / acc / rb bytes of the compute, accumulation
and GDN recurrent state dtypes."""

from __future__ import annotations

from ..defaults import keeps_attention_outputs
from .arch import Arch, LayerSpec
from .config import Basis
from .state_sizes import state_sizes

def kept_output_bytes(s: Basis, positions: int) -> float:
    """`keep_attention_outputs`: bytes of the outputs (compute dtype) and LSEs [H]
    (accumulation dtype) of `positions` recomputed prompt positions, per attention layer
    ([H, Dv]; sliding-window ones too: exact mode keeps all their rows) and dense MLA layer
    ([H, kv_lora_rank] over the latent: `kept_output_layers`). GDN layers and sparse DSA
    attention keep none (their walk computes it again)."""
    if not keeps_outputs(s):
        return 0.0
    return float(positions * kept_output_bytes_per_token(s.arch, s.b, s.acc, s.P))


def keeps_outputs(s: Basis) -> bool:
    """`keep_attention_outputs` resolved by the engine's rule (`defaults.keeps_attention_outputs`):
    None keeps them only where the device runs the fused backward (`PlanConfig.fused_backward`)."""
    a, c = s.arch, s.config
    return keeps_attention_outputs(c.keep_attention_outputs, exact=s.exact, offload_state=c.offload_state,
                                   parallel=s.W > 1, fused_backward=c.fused_backward,
                                   output_bytes=kept_output_bytes_per_token(a, s.b, s.acc, s.P),
                                   state_bytes=exact_state_bytes_per_token(a, s.b, s.acc, s.rb, s.P))


def kept_output_bytes_per_token(arch: Arch, b: int, acc: int, P: int) -> float:
    """Bytes `keep_attention_outputs` keeps per prompt position: H * (Dv * b + acc) per
    kept layer (`kept_output_layers`; MLA: Dv = kv_lora_rank). b: compute dtype bytes; acc:
    the LSE's (accumulation dtype)."""
    per = {"attention": arch.heads * (arch.head_dim * b + acc), "mla": arch.heads * (arch.kv_lora_rank * b + acc)}
    return float(sum(per[layer.mixer] for layer in kept_output_layers(arch, P)))


def exact_state_bytes_per_token(arch: Arch, b: int, acc: int, rb: int, P: int) -> float:
    """Bytes exact mode holds per prompt position for the state: its per-token rows
    (`state_sizes`, sliding windows kept whole) and their gradients in the accumulation
    dtype (as `plan_state`). The yardstick of the kept-outputs rule."""
    per = state_sizes(arch, b, rb, P, keep_windows=True)["per_token"]
    return float(per + per * acc // b)


def kept_output_layers(arch: Arch, P: int) -> list[LayerSpec]:
    """The layers whose attention outputs `keep_attention_outputs` keeps: GQA / MQA attention,
    and MLA whose queries select every position they see (no DSA, or a top-k >= P)."""
    return [layer for layer in arch.layers if layer.mixer == "attention"
            or (layer.mixer == "mla" and (not layer.sparse or (arch.index_topk or 0) >= P))]
