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
               with graph, a reader of their accumulated gradient) as seeds of the last
               state; a capture run with autograd on records them too (a kept graph).
               Divided (`call.divided`, a `divided.DividedChunk`): the tokens are this
               rank's own positions of the chunk; see `divided.py`
    decode     a rollout step: G branches, one token each at position `start`; their
               K/V go into the per-branch `call.branches`, and the shared prompt state
               is only read (`ops/decode_attention.py`)
    divided    context parallelism's divided capture: the tokens are this rank's own
               positions (`call.positions`), the whole prompt in one call; see `divided.py`
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from longstraw.state.branch import BranchKV, BranchState
from ..ops.attention import prefix_causal_attention
from ..ops.decode_attention import decode_attention
from longstraw.state.offload import restage_on_backward, staged_layers, stager_of, write_back
from longstraw.state.prompt import AttentionKV, PromptState

IMPLEMENTATION = "longstraw"


@dataclass
class AttentionCall:
    """What the attention function needs to know about the tokens being run.

    Fields:
        states: stacked states, earliest first; `states[i].layers[layer_idx]` is an
            `AttentionKV`. Capture and recompute act on the last one.
        start: absolute position of the first token of this call.
        phase: "capture", "replay", "recompute" or "decode" (see the module docstring).
        block_size: prefix positions per attention block.
        branches: phase "decode" only: the G branches' own state.
        positions: the tokens' absolute positions [T] when they are not start.. (phase
            "divided": this rank's own positions).
        divided: phase "divided": a `divided.Divided`; phase "recompute" of a divided
            reverse walk: a `divided.DividedChunk`; None otherwise.
    """

    states: list[PromptState]
    start: int
    phase: str
    block_size: int
    branches: BranchState | None = None
    positions: torch.Tensor | None = None
    divided: object = None

    def records_roots(self) -> bool:
        """Whether the chunk's own state tensors are recorded as roots of its graph
        (`PromptState.seeds`): in a recompute, and in a capture that keeps its graph
        (run with autograd on)."""
        return self.phase == "recompute" or (self.phase == "capture" and torch.is_grad_enabled())


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
    if call.phase == "decode":
        return _decode_attention(module, query, key, value, call, scaling, sliding_window)
    if call.phase == "divided":
        from .divided import divided_attention

        assert sliding_window is None or sliding_window >= call.divided.total, "divided capture: full attention only"
        return divided_attention(module, query, key, value, call, scaling)
    if call.phase == "recompute" and call.divided is not None:
        from .divided import divided_recompute_attention

        return divided_recompute_attention(module, query, key, value, call, scaling)
    if query.shape[0] != 1:
        raise RuntimeError(f"longstraw runs one sequence at a time, got batch {query.shape[0]}")
    if dropout:
        raise RuntimeError("attention dropout is not supported; put the model in eval mode")
    layers: list[AttentionKV] = staged_layers(call.states, module.layer_idx, call.start)  # offloaded: in a slot
    kv = call.states[-1].layers[module.layer_idx]  # the state itself (host rows when offloaded)
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
        layers[-1].append(key[0], value[0])
        write_back(call.states, module.layer_idx)
    if call.records_roots() and call.start + key.shape[2] <= kv.end:  # held: its gradient seeds the chunk
        read = seed_reader(kv, call.start, call.start + key.shape[2], device=key.device,
                           stager=stager_of(call.states[-1], module.layer_idx))
        call.states[-1].seeds.append(((key[0], value[0]), read))
    out = restage_on_backward(out, call.states, module.layer_idx, call.start)
    return out.transpose(0, 1)[None], None


def seed_reader(held, start: int, end: int, parts: int = 2, device=None, stager=None):
    """A function returning the gradients accumulated for the rows of positions [start,
    end) of `held` (an AttentionKV or LatentKV; the first `parts` of (dk, dv)), on
    `device` (default: the state's; the compute device when the state is offloaded to
    host: `stager` then counts the bytes it moves), summed over ranks when it is a
    shard: the seeds of a chunk's own state, read when the chunk is walked back."""
    def read():
        seeds = held.chunk_grads(start, end)[:parts]
        if stager is not None:  # host -> compute device ([.., end - start, ..]: zeros on rows another rank holds)
            stager.stats.h2d_bytes += sum(g.numel() * g.element_size() for g in seeds)
        seeds = [g.to(device) for g in seeds]
        if held.shard is not None:  # each rank holds its rows' gradients: sum them
            from longstraw.parallel.context import all_reduce_sum

            for seed in seeds:
                all_reduce_sum(seed, held.shard.cp)
        return seeds
    return read


def merge_shard(out, lse, segment):
    """Merge a context-parallel shard's partial attention (o, lse) across ranks."""
    from longstraw.parallel.context import MergeAcrossRanks

    return MergeAcrossRanks.apply(out, lse, segment.cp)


def _decode_attention(module, query, key, value, call: AttentionCall, scaling, sliding_window):
    """Phase "decode": query [G, H, 1, D], key/value [G, Hkv, 1, D] of the G branches' new
    tokens. Returns ([G, 1, H, Dv], None)."""
    own: BranchKV = call.branches.layers[module.layer_idx]
    assert own.window == sliding_window, f"layer {module.layer_idx}: {own.window} != {sliding_window}"
    own.append(key, value)
    own_k, own_v = own.keys()
    prefixes = [layer.segment(until=call.start) for layer in staged_layers(call.states, module.layer_idx, call.start)]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = decode_attention(query[:, :, 0], own_k, own_v, own_start=own.start, prefixes=prefixes,
                           q_position=call.start, scale=scale, window=sliding_window, block_size=call.block_size,
                           reduce_shard=merge_shard)  # (G, H, Dv)
    return out[:, None], None


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
    """Run the model's own decoder stack.

    One sequence: input_ids [T] at positions start.. -> hidden [T, d].
    Phase "decode": input_ids [G], one token per branch, all at position start -> hidden [G, d].
    """
    if call.phase == "decode":
        ids = input_ids[:, None]  # (G, 1): a batch of G one-token sequences
        positions = torch.full_like(ids, call.start)
    elif call.positions is not None:
        ids, positions = input_ids[None], call.positions[None]  # (1, T)
    else:
        ids = input_ids[None]  # (1, T)
        positions = torch.arange(call.start, call.start + input_ids.shape[0], device=input_ids.device)[None]
    with routed(config, call):
        out = backbone(input_ids=ids, position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state
    return hidden[:, 0] if call.phase == "decode" else hidden[0]
