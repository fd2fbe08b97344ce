"""Full attention (GQA / MQA, sliding windows) in every phase: the function registered with
`transformers` as "longstraw", which a dense or hybrid family's own attention modules call
with their q/k/v after RoPE (routing: `routing.py`).

Per phase (`routing.Phase`):

    CAPTURE / REPLAY / RECOMPUTE  `chunk_attention`: LSE-merged prefix attention over the
               stacked states' K/V (`ops/attention.py`) plus the tokens' own causal part;
               capture appends the new K/V, a recompute seeds them (`seed_reader`)
    DECODE     `decode_attention`: G branches, one token each; their K/V go into the
               branches' own state and the shared prompt state is only read
               (`ops/decode_attention.py`)
    DIVIDED    `divided_attention` (context parallelism's divided capture): the layer's
               own K/V rows go into the sharded state, then the queries attend over
               every rank's rows, fetched piece by piece (`parallel/attention.py`); the
               global causal order and a sliding window (by position, across the ranks'
               blocks) are exact
    RECOMPUTE of a divided reverse walk: `divided_recompute_attention`: gathers the
               chunk's q/k/v rows, attends as the replicated walk does (the chunk's own
               causal part for this rank's query rows only), and keeps this rank's rows

Shapes: H query heads, Hkv kv heads, T new tokens (N or n: this rank's own), D / Dv head
dims, G branches.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from longstraw.errors import UnsupportedModelError
from longstraw.ops.attention import prefix_causal_attention
from longstraw.ops.decode_attention import decode_attention
from longstraw.ops.flash import keeps_outputs, merge_sink
from longstraw.parallel.attention import divided_causal_attention
from longstraw.parallel.collectives import MergeAcrossRanks, all_reduce_sum, merge_gathered
from longstraw.state.branch import BranchKV
from longstraw.state.offload import restage_on_backward, staged_layers, stager_of, write_back
from longstraw.state.prompt import AttentionKV

from .routing import IMPLEMENTATION, AttentionCall, Divided, DividedChunk, Phase, current_call


def softmax_scale(scaling: float | None, head_dim: int) -> float:
    """The attention's softmax scale: the module's own `scaling`, else HF's default
    head_dim ** -0.5."""
    return scaling if scaling is not None else head_dim ** -0.5


def longstraw_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        sliding_window=None, s_aux=None, softcap=None, **kwargs):
    """The registered attention function (HF's attention-interface signature).

    query: [1, H, T, D]; key, value: [1, Hkv, T, D] for the T new tokens, after RoPE
    (phase DECODE: [G, H, 1, D], [G, Hkv, 1, D]). `s_aux`: gpt-oss's attention sinks,
    [H] learned logits joining each softmax denominator with no value (merged once into
    the attention's LSE; their gradient flows). Returns ([1, T, H, Dv], None), as HF's
    eager attention does ([G, 1, H, Dv] for decode).
    """
    if softcap is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} soft-caps its attention logits (softcap={softcap}); LongStraw's LSE-merged "
            "attention does not apply a soft-cap. Set the config's attn_logit_softcapping to None")
    call = current_call()
    run = call.route(chunk=chunk_attention, decode=_decode_attention, divided=divided_attention,
                     divided_walk=divided_recompute_attention)
    scale = softmax_scale(scaling, query.shape[-1])
    return run(module, query, key, value, call, scale, sliding_window=sliding_window, dropout=dropout, sinks=s_aux)


def chunk_attention(module, query, key, value, call: AttentionCall, scale: float, *, sliding_window, dropout,
                    sinks=None):
    """Phases CAPTURE, REPLAY, RECOMPUTE: query [1, H, T, D], key/value [1, Hkv, T, D] at
    positions start.. -> ([1, T, H, Dv], None). REPLAY may run a batch of B branches
    (batched replay, `engine/batched.py`): [B, H, T, D], [B, Hkv, T, D] -> ([B, T, H, Dv],
    None), every branch over the same stacked states (read, never copied)."""
    batch = query.shape[0]
    if batch != 1 and call.phase is not Phase.REPLAY:
        raise RuntimeError(f"longstraw runs one sequence at a time outside replay, got batch {batch}")
    if dropout:
        raise RuntimeError("attention dropout is not supported; put the model in eval mode")
    layers: list[AttentionKV] = staged_layers(call.states, module.layer_idx, call.start)  # offloaded: in a slot
    kv = call.states[-1].layers[module.layer_idx]  # the state itself (host rows when offloaded)
    window = sliding_window
    if window is not None and call.start + key.shape[2] <= window:
        window = None  # the window covers every position so far: full attention
    assert kv.window in (sliding_window, window), f"layer {module.layer_idx}: state window {kv.window} != {window}"
    assert kv.end == call.start or call.phase is not Phase.CAPTURE, (kv.end, call.start)
    keep, kept = kept_attention(call, module.layer_idx, query[0], value.shape[-1], window, sinks,
                                sharded=kv.shard is not None)  # exact mode's kept outputs, or (False, None)
    q, k, v = (query[0], key[0], value[0]) if batch == 1 else (query, key, value)
    out = prefix_causal_attention(
        q, k, v, prefixes=[layer.segment(until=call.start) for layer in layers],
        q_start=call.start, scale=scale, window=window, block_size=call.block_size, sinks=sinks,
        return_lse=keep, kept=kept,
    )  # (H, T, Dv); a batch: (B, H, T, Dv)
    if keep:  # the walk's attention backward reads these instead of attending again
        out, lse = out
        call.states[-1].outputs.put(module.layer_idx, call.start, out, lse)
    if call.phase is Phase.CAPTURE:
        layers[-1].append(key[0], value[0])
        write_back(call.states, module.layer_idx)
    if call.records_roots() and call.start + key.shape[2] <= kv.end:  # held: its gradient seeds the chunk
        read = seed_reader(kv, call.start, call.start + key.shape[2], device=key.device,
                           stager=stager_of(call.states[-1], module.layer_idx))
        call.states[-1].seeds.append(((key[0], value[0]), read))
    out = restage_on_backward(out, call.states, module.layer_idx, call.start)
    return (out.transpose(0, 1)[None] if batch == 1 else out.transpose(1, 2)), None


def kept_attention(call: AttentionCall, layer: int, q: torch.Tensor, value_dim: int, window, sinks, *,
                   sharded: bool) -> tuple[bool, tuple | None]:
    """Exact mode's kept attention outputs (`state/kept_outputs.py`) for this call of layer
    `layer` with queries q [H, T, D]: (keep, kept). keep: a capture chunk (no autograd)
    whose output and LSE the walk can use (`flash.keeps_outputs`): ask for the LSE and put
    both in the store. kept: in the prompt's walk, this chunk's (o, lse) from the store, or
    None (the walk attends again)."""
    store = call.states[-1].outputs
    if store is None:
        return False, None
    keep = (call.phase is Phase.CAPTURE and not torch.is_grad_enabled()
            and keeps_outputs(q, value_dim, window, sinks, sharded))
    walk = call.phase is Phase.RECOMPUTE and len(call.states) == 1
    return keep, (store.get(layer, call.start, q.shape[1]) if walk else None)


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
            for seed in seeds:
                all_reduce_sum(seed, held.shard.cp)
        return seeds
    return read


def merge_shard(out, lse, segment):
    """Merge a context-parallel shard's partial attention (o, lse) across ranks, in a
    decode step (no grad): one all-gather of the small partials (`merge_gathered`), not
    two all-reduces: a decode step's collectives cost their latency, once per step.
    Under autograd, the differentiable two all-reduces (`MergeAcrossRanks`)."""
    if torch.is_grad_enabled() and (out.requires_grad or lse.requires_grad):
        return MergeAcrossRanks.apply(out, lse, segment.cp)
    return merge_gathered(out, lse, segment.cp)


def _decode_attention(module, query, key, value, call: AttentionCall, scale: float, *, sliding_window, dropout,
                      sinks=None):
    """Phase DECODE: query [B, H, 1, D], key/value [B, Hkv, 1, D] of the new tokens of
    the B branches `call.rows` (None: all G), each at its own position (`call.decode_positions`).
    Returns ([B, 1, H, Dv], None)."""
    own: BranchKV = call.branches.layers[module.layer_idx]
    assert own.window == sliding_window, f"layer {module.layer_idx}: {own.window} != {sliding_window}"
    own.append(key, value, call.rows)
    own_k, own_v = own.keys(call.rows)  # (B, Hkv, n, D): n the longest branch's rows
    lengths = torch.tensor(own.lengths_of(call.rows), device=query.device)  # (B,)
    prefixes = [layer.segment(until=own.start) for layer in staged_layers(call.states, module.layer_idx, own.start)]
    out = decode_attention(query[:, :, 0], own_k, own_v, own_start=own.start, prefixes=prefixes,
                           q_position=call.decode_positions(), scale=scale, window=sliding_window,
                           block_size=call.block_size, reduce_shard=merge_shard, own_lengths=lengths,
                           sinks=sinks)  # (G, H, Dv)
    return out[:, None], None


# ----------------------------------------------------------------------------
# context parallelism


def divided_attention(module, query, key, value, call: AttentionCall, scale: float, *, sliding_window, dropout,
                      sinks=None):
    """Phase DIVIDED: query [1, H, N, D], key/value [1, Hkv, N, D] of this rank's positions
    -> ([1, N, H, Dv], None)."""
    d: Divided = call.divided
    kv = call.states[-1].layers[module.layer_idx]
    assert kv.window == sliding_window, f"layer {module.layer_idx}: state window {kv.window} != {sliding_window}"
    window = sliding_window if sliding_window is not None and sliding_window < d.total else None
    out = divided_causal_attention(query[0], key[0], value[0], positions=d.total, rank=d.rank, world=d.world,
                                   block=d.block, scale=scale, cp=d.cp, piece_rows=d.chunk_size,
                                   sinks=sinks, window=window)  # (H, N, Dv)
    kv.append_own(key[0], value[0], d.total)  # (a sliding window's then trimmed to its last W - 1 positions)
    return out.transpose(0, 1)[None], None


def divided_recompute_attention(module, query, key, value, call: AttentionCall, scale: float, *, sliding_window,
                                dropout, sinks=None):
    """A divided reverse walk's attention (exact mode): query [1, H, n, D], key/value
    [1, Hkv, n, D] of this rank's n positions of the chunk -> ([1, n, H, Dv], None).

    The chunk's q/k/v rows of every rank are gathered (`DividedChunk.gather`), and the
    attention of the whole chunk runs as in the replicated walk, except that its own causal
    part runs for this rank's query rows only, the ranks' partials gathered (`own_rows`),
    and the part over earlier chunks is divided by the sharded state (partials merged
    across ranks). Only this rank's output rows go on (`DividedChunk.own_rows`: their
    gradient is summed over ranks, so that the attention's backward sees the whole chunk's
    upstream gradient, identical on every rank), and each rank keeps the q/k/v gradient
    of its own rows. This rank's own K/V rows are the chunk's roots, seeded with the
    gradients its shard accumulated for them (no all-reduce of seeds)."""
    d: DividedChunk = call.divided
    kv = call.states[-1].layers[module.layer_idx]
    assert len(call.states) == 1 and kv.shard is not None and not kv.trim, "divided walk: an untrimmed sharded prompt"
    window = sliding_window if sliding_window is not None and d.end > sliding_window else None  # None: covers all
    q, k, v = query[0], key[0], value[0]  # (H, n, D), (Hkv, n, D), (Hkv, n, Dv)
    h, hkv = q.shape[0], k.shape[0]
    if k.shape[-1] == v.shape[-1]:  # one all-gather for the three
        full_q, full_k, full_v = d.gather(torch.cat([q, k, v])).split([h, hkv, hkv])
    else:
        full_q, full_k, full_v = (d.gather(x) for x in (q, k, v))
    out, lse = prefix_causal_attention(full_q, full_k, full_v, prefixes=[kv.segment(until=d.start)],
                                       q_start=d.start, scale=scale, window=window, block_size=call.block_size,
                                       own_rows=(d.rows(q.device), d.cp), return_lse=True)  # (H, T, Dv), (H, T)
    out = d.own_rows(out)  # (H, n, Dv)
    if sinks is not None:  # on this rank's rows only: the sinks' gradient is a partial, summed over ranks
        out = merge_sink(out, d.own_rows(lse[..., None])[..., 0], sinks[:, None]).to(q.dtype)
    if d.end <= kv.end:  # held: its gradient seeds the chunk
        call.states[-1].seeds.append(((k, v), lambda: kv.own_grads(d.start, d.end)))
    return out.transpose(0, 1)[None], None


ALL_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, longstraw_attention)
