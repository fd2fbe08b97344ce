"""Route a Hugging Face model's own attention modules through LongStraw's attention.

Every supported family computes q/k/v (projections, q/k norms, RoPE, output gates)
inside its attention module and then calls the function registered in
`transformers`' `ALL_ATTENTION_FUNCTIONS` under `config._attn_implementation`. We
register one function, "longstraw", and switch a model to it only inside
`routed(...)`. The model's own modules therefore do all the projections, and LoRA /
PEFT wrappers on them keep working untouched.

Inside the function, the current `AttentionCall` names the stacked states to attend
to (the prompt state; for a branch replayed in pieces, also the state of its earlier
pieces) and what to do with the new tokens' K/V in the last of them:

    capture    append them (under no_grad)
    replay     only read; where a state has gradient buffers, backward adds
               dLoss/dState into them
    recompute  reverse walk: attend to what lies before `start`, and record (new K/V
               with graph, their accumulated gradient) as seeds of the last state
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops.attention import prefix_causal_attention
from ..state import AttentionKV, PromptState

IMPLEMENTATION = "longstraw"


@dataclass
class AttentionCall:
    """What the attention function needs to know about the tokens being run.

    Fields:
        states: stacked states, earliest first; `states[i].layers[layer_idx]` is an
            `AttentionKV`. Capture and recompute act on the last one.
        start: absolute position of the first token of this call.
        phase: "capture", "replay" or "recompute" (see the module docstring).
        block_size: prefix positions per attention block.
    """

    states: list[PromptState]
    start: int
    phase: str
    block_size: int


_CURRENT: contextvars.ContextVar[AttentionCall | None] = contextvars.ContextVar("longstraw_attention", default=None)


def current_call() -> AttentionCall:
    """The `AttentionCall` of the run in progress."""
    call = _CURRENT.get()
    if call is None:
        raise RuntimeError("a longstraw-routed layer was called outside an Engine run")
    return call


def longstraw_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        sliding_window=None, **kwargs):
    """The registered attention function (HF's attention-interface signature).

    query: [1, H, T, D]; key, value: [1, Hkv, T, D] for the T new tokens, after RoPE.
    Returns ([1, T, H, Dv], None), as HF's eager attention does.
    """
    call = current_call()
    if query.shape[0] != 1:
        raise RuntimeError(f"longstraw runs one sequence at a time, got batch {query.shape[0]}")
    if dropout:
        raise RuntimeError("attention dropout is not supported; put the model in eval mode")
    layers: list[AttentionKV] = [state.layers[module.layer_idx] for state in call.states]
    kv = layers[-1]
    window = sliding_window
    if window is not None and call.start + key.shape[2] <= window:
        window = None  # the window covers every position so far: full attention (a sharded state holds no window)
    assert kv.window in (sliding_window, window), f"layer {module.layer_idx}: state window {kv.window} != {window}"
    assert kv.end == call.start or call.phase != "capture", (kv.end, call.start)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = prefix_causal_attention(
        query[0], key[0], value[0], prefixes=[layer.segment(until=call.start) for layer in layers],
        q_start=call.start, scale=scale, window=window, block_size=call.block_size,
    )  # (H, T, Dv)
    if call.phase == "capture":
        kv.append(key[0], value[0])
    elif call.phase == "recompute" and call.start + key.shape[2] <= kv.end:  # held: seed it
        k_seed, v_seed = kv.chunk_grads(call.start, call.start + key.shape[2])
        if kv.shard is not None:  # each rank holds its rows' gradients: sum them
            from ..distributed import all_reduce_sum

            all_reduce_sum(k_seed, kv.shard.cp), all_reduce_sum(v_seed, kv.shard.cp)
        call.states[-1].seeds += [(key[0], k_seed), (value[0], v_seed)]
    return out.transpose(0, 1)[None], None


ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, longstraw_attention)


@contextlib.contextmanager
def routed(config, call: AttentionCall):
    """Within the block, `config`'s model attends through LongStraw with `call`."""
    previous = config._attn_implementation_internal
    token = _CURRENT.set(call)
    config._attn_implementation_internal = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation_internal = previous
        _CURRENT.reset(token)


def run_backbone(backbone, config, input_ids: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """Run the model's own decoder stack on T tokens. input_ids [T] -> hidden [T, d]."""
    positions = torch.arange(call.start, call.start + input_ids.shape[0], device=input_ids.device)
    with routed(config, call):
        out = backbone(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
    return out.last_hidden_state[0]
