"""Compressed-attention MoE families: GLM-5.x (`glm_moe_dsa`), DeepSeek-V3.2
(`deepseek_v32`) and DeepSeek-V3 (`deepseek_v3`, MLA without DSA).

State per token per layer (`MLAState`): the normalized compressed latent
[kv_lora_rank] and the RoPE'd shared rope key [qk_rope_head_dim], one row
(`LatentKV`), plus the indexer key [index_head_dim] for layers with their own DSA
indexer (`IndexKeys`). Nothing is ever expanded per head at prompt scale.

Each attention module's `forward` is replaced, on the instance and only inside
`routed_mla`, by `mla_forward`, which calls the module's own projections and norms and
the model file's own RoPE functions, and then attends in absorbed form (the maths of
DeepSeek's inference):

    q_abs[h]  = W_uk[h]^T q_nope[h]                    query into latent space   (H, T, R)
    score     = q_abs . latent + q_rope . k_rope       one shared (MQA) key row  (R + Dr)
    o_lat[h]  = softmax(score) @ latent                                           (H, T, R)
    out[h]    = W_uv[h] o_lat[h]                       back out through kv_b_proj's value half

where W_uk / W_uv are the key / value halves of kv_b_proj's effective weight (a PEFT
adapter's own change to it included, when one wraps it: `peft_layers.py`, which refuses the
adapters it cannot reproduce). DSA layers select per query the top-k positions
(prompt + branch) with the model's own indexer modules, no grad, ties broken by the
lower position (HF breaks ties arbitrarily; ours never depends on chunking), globally
over the whole prompt; "shared" layers (GLM-5) reuse the previous layer's selection.
Attention is then restricted to the selected rows by gathering them
(`ops/dsa.sparse_latent_attention`), not by a dense mask over P.

Per phase (`routing.Phase`; one switch, `AttentionCall.route`):

    CAPTURE / REPLAY / RECOMPUTE  `_mla_chunk`: dense or sparse attention over the
               stacked states' latent rows and the new ones; capture appends the rows
               (and indexer keys), a recompute seeds them
    DECODE     `_mla_decode`: G branches, one token each (`mla_decode.py`)
    DIVIDED    `divided_mla` (context parallelism's divided capture): the layer's own
               latent rows (and indexer keys) go into the sharded state; its absorbed
               queries attend over every rank's latent rows (fetched piece by piece),
               or, with DSA, over the rows of the global top-k (selected over every
               rank's indexer keys, fetched piece by piece)
    RECOMPUTE of a divided reverse walk: `_mla_chunk` after `gather_mla_chunk`
               gathers the chunk's absorbed queries and latent rows (and the
               indexer's inputs, no grad); it attends as the replicated walk does and
               keeps this rank's rows (`DividedChunk.own_rows`)

Legend: H heads, T new tokens (N, n: this rank's own), R = kv_lora_rank, Dr rope dim,
Dv value head dim, K top-k, Hi / Di indexer heads / dim, G branches.
"""

from __future__ import annotations

import bisect
import functools
import sys
from dataclasses import dataclass

import torch

from longstraw.defaults import select_query_block
from longstraw.errors import UnsupportedModelError
from longstraw.ops.attention import prefix_causal_attention
from longstraw.ops.dsa import indexer_scores, indexer_topk, select_candidates, sparse_latent_attention
from longstraw.ops.flash import merge_partials
from longstraw.parallel.attention import divided_causal_attention
from longstraw.parallel.divided_dsa import divided_indexer_topk, divided_sparse_attention
from longstraw.parallel.collectives import MergeAcrossRanks, SumGradAcrossRanks, gather_rows
from longstraw.state.branch import BranchLatent, BranchState
from longstraw.state.offload import restage_on_backward, staged_layers, stager_of, write_back
from longstraw.state.prompt import HOST, IndexKeys, LatentKV, MLAState, PromptState
from longstraw.tensors import KVSegment

from .attention import kept_attention, seed_reader
from .base import Adapter
from .mla_decode import mla_decode, prompt_candidates
from .peft_layers import check_affine, effective_affine
from .mla_batch import each_branch
from .routing import Divided, DividedChunk, Phase, current_call, forwards_replaced

def check_dense_weight(linear, where: str) -> None:
    """Absorbed MLA multiplies by kv_b_proj's weight matrix itself: refuse a quantized or
    packed one (bitsandbytes NF4/int8, fp8), which is not a plain float matrix."""
    weight = getattr(getattr(linear, "base_layer", linear), "weight", None)
    if weight is None or weight.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise UnsupportedModelError(
            f"{where}: kv_b_proj's base weight is {getattr(weight, 'dtype', None)} ({type(weight).__name__}); "
            "absorbed MLA needs it as a float matrix, so quantized/packed base weights (NF4, int8, fp8) are not "
            "supported for MLA models: load that projection in bf16 (e.g. bitsandbytes llm_int8_skip_modules="
            "['kv_b_proj'])"
        )


def _rope_functions(module, model_type: str):
    """(main MLA rope, indexer rope) from the model's own modeling file."""
    mod = sys.modules[type(module).__module__]
    interleave, half = mod.apply_rotary_pos_emb_interleave, getattr(mod, "apply_rotary_pos_emb", None)
    if model_type == "deepseek_v3":
        return (interleave if module.config.rope_interleave else half), None
    if model_type == "deepseek_v32":
        return interleave, half
    return interleave, interleave  # glm_moe_dsa


def _indexer_inputs(indexer, x, q_resid, cos, sin, index_rope):
    """The model's own indexer projections for the T new tokens, no grad (as in HF):
    queries [T, Hi, Di], keys [T, Di] (model dtype) and head weights [T, Hi] (fp32)."""
    t = x.shape[0]
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(1, t, indexer.n_heads, indexer.head_dim)
        split = [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim]
        q_rot, q_pass = torch.split(q, split, dim=-1)
        k_rot, k_pass = torch.split(indexer.k_norm(indexer.wk(x[None])).unsqueeze(2), split, dim=-1)  # (1, T, 1, *)
        q_rot, k_rot = index_rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)[0]  # (T, Hi, Di)
        keys = torch.cat([k_rot, k_pass], dim=-1)[0, :, 0]  # (T, Di)
        weights = indexer.weights_proj(x.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads ** -0.5
    return q, keys, weights


def _select(indexer, layers, q, keys, weights, call, own=None):
    """Top-k absolute positions [T, K] (-1: none) over the whole prompt and the new
    tokens (causal), scored in float32 as HF does, ties to the lower position.
    `layers`: the stacked states' `MLAState`s of this layer (staged, when offloaded).
    `own` (a divided walk's `DividedChunk`): see `_select_across_ranks`."""
    held = [layer.index for layer in layers if layer.index is not None]
    if any(ix.shard is not None for ix in held):
        return _select_across_ranks(indexer, q, keys, weights, call, held, own=own)
    segments = [(ix.until(call.start), ix.start) for ix in held]  # scored in fp32 block by block, never copied whole
    with torch.no_grad():
        return indexer_topk(q.float(), weights, segments, keys, call.start, indexer.index_topk,
                            scale=indexer.softmax_scale)


@torch.no_grad()
def _select_across_ranks(indexer, q, keys, weights, call, held, query_block: int | None = None, own=None):
    """Context parallelism: the same global selection as one process. Each rank takes the
    top-k of its own shard of the prompt's indexer keys; an all-gather collects every
    rank's candidates (positions and scores); the replicated keys (a branch's earlier
    pieces, the new tokens) add theirs; the top-k of that union, by the same order
    (score, then lower position), is the global top-k, since every member of the global
    top-k is in its own shard's top-k.

    `own` (a divided walk's `DividedChunk`, whose rows() are the query rows each rank owns): the shard
    candidates are still taken for every query (each rank's shard serves all of them),
    but each rank scores the replicated keys and merges only for its own rows, and the
    rows' selections are then gathered (one all-gather of [n, K] positions). Which rows a
    block holds is known on the host (no read of device data)."""
    topk, scale, t = indexer.index_topk, indexer.softmax_scale, q.shape[0]
    shard_ix = next(ix for ix in held if ix.shard is not None)
    others = [ix for ix in held if ix.shard is None]
    rep_keys = torch.cat([ix.until(call.start) for ix in others] + [keys])
    rep_pos = torch.cat([ix.positions(call.start) for ix in others]
                        + [torch.arange(call.start, call.start + t, device=q.device)])
    if query_block is None:  # larger blocks where a rank sees few keys (`defaults.select_query_block`)
        query_block = select_query_block(shard_ix.until(call.start).shape[0] + rep_keys.shape[0])
    mine = range(t) if own is None else own.host_rows()  # this rank's query rows, increasing (host ints)
    out = torch.full((t, topk), -1, dtype=torch.long, device=q.device)
    for b0 in range(0, t, query_block):
        b1 = min(t, b0 + query_block)
        qb, wb = q[b0:b1].float(), weights[b0:b1]
        shard_pos, shard_sc = prompt_candidates(qb, wb, shard_ix, call.start, topk, scale)  # every rank's, gathered
        rows = [r - b0 for r in mine[bisect.bisect_left(mine, b0):bisect.bisect_left(mine, b1)]]
        if not rows:  # none of the block's rows is this rank's
            continue
        rows = torch.tensor(rows, device=q.device)  # the block's rows this rank selects for
        seen = rep_keys.shape[0] - t + b1  # rep_pos increases: the block's last query sees this many
        rep_sc = indexer_scores(qb[rows], wb[rows], rep_keys[:seen], scale=scale)  # (b, seen)
        query_pos = call.start + b0 + rows
        visible = rep_pos[None, :seen] <= query_pos[:, None]
        cand_pos = torch.cat([shard_pos[rows], torch.where(visible, rep_pos[None, :seen], -1)], dim=1)
        cand_sc = torch.cat([shard_sc[rows], rep_sc], dim=1)
        out[b0 + rows] = select_candidates(cand_sc, cand_pos, topk)
    if own is not None:  # (positions as int32 on the wire)
        index = own.rows(q.device)
        out = gather_rows(out[index[own.rank]].to(torch.int32), index, own.cp).long()
    return out


def _sparse_attention(q_full, k_new, latent, indices, latents, call, scale):
    """Gathered sparse attention over the selected rows of `latents` (the stacked states'
    `LatentKV`s) and the new tokens. With a context-parallel shard among them, each rank
    attends over the selected rows it holds, the partials are merged across ranks, and
    the replicated rows (a branch's earlier pieces, the new tokens) are merged in after.
    Returns [H, T, R]."""
    segments = [kv.segment(until=call.start) for kv in latents]
    sharded = [kv for kv in latents if kv.shard is not None]
    if not sharded:
        return sparse_latent_attention(q_full, k_new, latent, indices, prefixes=segments, q_start=call.start,
                                       scale=scale)
    kv = sharded[0]
    seg, shard = kv.segment(until=call.start), kv.shard
    safe = indices.clamp(min=0)
    in_shard = (indices >= kv.start) & (indices < min(kv.end, call.start))
    rows = shard.count(safe) - shard.count(kv.start)  # local row of an owned position
    local = torch.where(in_shard & shard.owns(safe), kv.start + rows, torch.full_like(indices, -1))
    own = KVSegment(seg.k, seg.v, seg.start, seg.grad)  # this rank's rows, addressed as consecutive positions
    out_a, lse_a = sparse_latent_attention(SumGradAcrossRanks.apply(q_full, seg.cp), k_new, latent, local,
                                           prefixes=[own], q_start=call.start, scale=scale, return_lse=True)
    out_a, lse_a = MergeAcrossRanks.apply(out_a, lse_a, seg.cp)
    rest = torch.where(in_shard, torch.full_like(indices, -1), indices)
    replicated = [s for s, k in zip(segments, latents) if k.shard is None]
    out_b, lse_b = sparse_latent_attention(q_full, k_new, latent, rest, prefixes=replicated, q_start=call.start,
                                           scale=scale, return_lse=True)
    return merge_partials(out_a, lse_a, out_b, lse_b).to(q_full.dtype)


@dataclass
class Absorbed:
    """One MLA layer's new tokens in absorbed form (see the module docstring).

    Fields:
        x: the layer's input [T, d] (decode: the G branches' tokens, as a sequence of G).
        q_resid: the normed q_a projection [T, q_lora_rank] the indexer reads (None without q LoRA).
        cos, sin: the RoPE tables as the model's rope functions take them.
        q_full: absorbed queries [H, T, R + Dr] (q_nope into latent space | RoPE'd q_rope).
        k_new: the new latent rows [T, R + Dr] (normed latent | RoPE'd shared rope key).
        latent: k_new's first R columns [T, R], the value.
        w_uv: kv_b_proj's value half [H, Dv, R]; b_uv: its bias [H, Dv] or None.
    """

    x: torch.Tensor
    q_resid: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    q_full: torch.Tensor
    k_new: torch.Tensor
    latent: torch.Tensor
    w_uv: torch.Tensor
    b_uv: torch.Tensor | None


def absorb(module, spec, x, position_embeddings, decode: bool) -> Absorbed:
    """The model's own projections, norms and RoPE of x [T, d], in absorbed form."""
    t, h = x.shape[0], module.num_heads
    nope, rope, rank, vdim = module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank, module.v_head_dim
    if getattr(module, "q_lora_rank", None) is not None:
        q_resid = module.q_a_layernorm(module.q_a_proj(x))
        q = module.q_b_proj(q_resid)
    else:
        q_resid, q = None, module.q_proj(x)
    q = q.view(t, h, nope + rope).transpose(0, 1)  # (H, T, nope + rope)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(x), [rank, rope], dim=-1)
    latent = module.kv_a_layernorm(kv_pass)  # (T, R)
    cos, sin = position_embeddings if spec["rope"] is not None else (None, None)  # Kimi Linear's MLA: NoPE
    if decode and cos is not None:  # [G, 1, Dr] at one position -> [1, G, Dr]
        cos, sin = cos[:, 0][None], sin[:, 0][None]
    if spec["rope"] is not None:
        q_rot, k_rot = spec["rope"](q_rot[None], k_rot.view(1, 1, t, rope), cos, sin)
        q_rot, k_rot = q_rot[0], k_rot[0, 0]  # (H, T, Dr), (T, Dr)

    w, bias = effective_affine(module.kv_b_proj)  # (H * (nope + Dv), R), (H * (nope + Dv),) or None
    w = w.view(h, nope + vdim, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # (H, nope, R), (H, Dv, R)
    # a bias on the keys adds q_nope . b_k to every score of a query: softmax ignores it;
    # one on the values adds b_v to every output, since the weights sum to 1
    b_uv = None if bias is None else bias.view(h, nope + vdim)[:, nope:]  # (H, Dv)
    q_full = torch.cat([torch.einsum("htn,hnr->htr", q_pass, w_uk), q_rot], dim=-1)  # (H, T, R + Dr)
    k_new = torch.cat([latent, k_rot], dim=-1)  # (T, R + Dr)
    return Absorbed(x=x, q_resid=q_resid, cos=cos, sin=sin, q_full=q_full, k_new=k_new, latent=latent, w_uv=w_uv,
                    b_uv=b_uv)


def mla_forward(module, spec, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
    """Drop-in for an MLA attention module's forward: hidden_states [1, T, d] ->
    [1, T, d] (phase DECODE: [G, 1, d] -> [G, 1, d]; for GLM-5, also the top-k indices
    the next "shared" layer reuses). `spec` holds the family's RoPE functions and DSA
    layout (see `MLAAdapter`)."""
    call = current_call()
    decode = call.phase is Phase.DECODE
    if not decode and hidden_states.shape[0] > 1:  # batched replay: each branch's attention in turn
        return each_branch(mla_forward, module, spec, hidden_states, position_embeddings, prev_topk_indices)
    x = hidden_states[:, 0] if decode else hidden_states[0]  # (T, d); decode: G tokens at one position
    a = absorb(module, spec, x, position_embeddings, decode)
    run = call.route(chunk=_mla_chunk, decode=_mla_decode, divided=_mla_divided, divided_walk=_mla_chunk)
    out, indices = run(module, spec, a, call, prev_topk_indices)
    return (out, None, indices) if spec["returns_topk"] else (out, None)


def shared_selection(prev_indices):
    """A GLM-5 "shared" DSA layer's selection: the previous layer's, [T, K]."""
    assert prev_indices is not None, "a shared DSA layer needs the previous layer's selection"
    return prev_indices


def _topk(module, spec) -> int | None:
    """The layer's DSA top-k: its own indexer's, a GLM-5 "shared" layer's, or None (no DSA)."""
    indexer = getattr(module, "indexer", None)
    return indexer.index_topk if indexer is not None else spec["shared_topk"]


def _index_inputs(module, spec, a: Absorbed):
    """The layer's own indexer inputs for the new tokens (`_indexer_inputs`), or None."""
    indexer = getattr(module, "indexer", None)
    return None if indexer is None else _indexer_inputs(indexer, a.x, a.q_resid, a.cos, a.sin, spec["index_rope"])


def _project_out(module, a: Absorbed, o_lat, call) -> torch.Tensor:
    """o_lat [H, T, R] -> the layer's output [1, T, d] through W_uv and o_proj."""
    h, t = o_lat.shape[0], o_lat.shape[1]
    o_lat = restage_on_backward(o_lat, call.states, module.layer_idx, call.start)
    out = torch.einsum("htr,hvr->thv", o_lat, a.w_uv)  # (T, H, Dv)
    return module.o_proj((out if a.b_uv is None else out + a.b_uv).reshape(1, t, h * module.v_head_dim))


def _mla_decode(module, spec, a: Absorbed, call, prev_indices):
    """Phase DECODE: the G branches' tokens -> (out [G, 1, d], indices [G, K] or None)."""
    layers: list[MLAState] = staged_layers(call.states, module.layer_idx, call.start)  # offloaded: in a slot
    assert len(layers) == 1, "decode reads one prompt state"
    indexer = getattr(module, "indexer", None)
    h, g = a.q_full.shape[0], a.x.shape[0]
    o_lat, indices = mla_decode(a.q_full.transpose(0, 1), a.k_new, call.branches.layers[module.layer_idx], layers[0],
                                position=call.decode_positions(), rows=call.rows, scale=module.scaling, rank=module.kv_lora_rank,
                                block_size=call.block_size, topk=_topk(module, spec),
                                index_inputs=_index_inputs(module, spec, a),
                                index_topk_scale=None if indexer is None else indexer.softmax_scale,
                                prev_indices=prev_indices)  # (G, H, R)
    out = torch.einsum("ghr,hvr->ghv", o_lat, a.w_uv)  # (G, H, Dv)
    out = module.o_proj((out if a.b_uv is None else out + a.b_uv).reshape(g, 1, h * module.v_head_dim))
    return out, indices


def _mla_divided(module, spec, a: Absorbed, call, prev_indices):
    """Phase DIVIDED: this rank's own positions (`divided_mla`) -> (out [1, N, d], indices)."""
    o_lat, indices = divided_mla(module, a.q_full, a.k_new, module.kv_lora_rank, _topk(module, spec), call,
                                 prev_indices, _index_inputs(module, spec, a))
    return _project_out(module, a, o_lat, call), indices


def _mla_chunk(module, spec, a: Absorbed, call, prev_indices):
    """Phases CAPTURE, REPLAY, RECOMPUTE (a divided reverse walk's too: the whole chunk's
    rows from every rank, `gather_mla_chunk`) -> (out [1, T, d], indices [T, K] or None)."""
    layers: list[MLAState] = staged_layers(call.states, module.layer_idx, call.start)  # offloaded: in a slot
    indexer, topk, rank = getattr(module, "indexer", None), _topk(module, spec), module.kv_lora_rank
    walk: DividedChunk | None = call.divided  # a divided reverse walk's chunk, or None
    q_full, k_new, latent, index_inputs = a.q_full, a.k_new, a.latent, _index_inputs(module, spec, a)
    if walk is not None:
        q_full, k_new, index_inputs = gather_mla_chunk(q_full, k_new, index_inputs, call)
        latent = k_new[:, :rank]
    own_rows = None if walk is None else (walk.rows(q_full.device), walk.cp)  # this rank's query rows
    indices = None
    if topk is not None and topk < call.start + k_new.shape[0]:  # some query sees more than top-k positions
        if indexer is not None:  # a divided walk selects for its own rows (`_select_across_ranks`)
            index_q, new_index_keys, index_w = index_inputs
            indices = _select(indexer, layers, index_q, new_index_keys, index_w, call, own=walk)
        else:
            indices = shared_selection(prev_indices)
        o_lat = _sparse_attention(q_full, k_new, latent, indices, [layer.latent for layer in layers], call,
                                  module.scaling)
    else:  # every query selects all it sees: dense (the indexer keys are still kept); a walk's self part divided
        segments = [layer.latent.segment(until=call.start) for layer in layers]
        keep, kept = kept_attention(call, module.layer_idx, q_full, latent.shape[-1], None, None,
                                    sharded=layers[-1].latent.shard is not None) if walk is None else (False, None)
        o_lat = prefix_causal_attention(q_full, k_new[None], latent[None], prefixes=segments, q_start=call.start,
                                        scale=module.scaling, block_size=call.block_size, own_rows=own_rows,
                                        return_lse=keep, kept=kept)
        if keep:  # exact mode's kept attention outputs: the walk attends no more (`state/kept_outputs.py`)
            o_lat, lse = o_lat
            call.states[-1].outputs.put(module.layer_idx, call.start, o_lat, lse)
    if walk is not None:
        o_lat = walk.own_rows(o_lat)  # (H, t, R)
    out = _project_out(module, a, o_lat, call)
    _keep_rows(module, a, call, layers, None if index_inputs is None else index_inputs[1], k_new)
    return out, indices


def _keep_rows(module, a: Absorbed, call, layers, new_index_keys, k_new):
    """After the attention: capture appends the new latent rows (and indexer keys) to the
    state; a recompute (or a capture that keeps its graph) records them as the chunk's
    roots, with a reader of their accumulated gradient. `k_new`: the rows attended with
    (a divided walk's: the whole chunk's)."""
    own = call.states[-1].layers[module.layer_idx]  # the state itself (host rows when offloaded)
    walk, t = call.divided, a.x.shape[0]
    if call.phase is Phase.CAPTURE:
        layers[-1].latent.append(k_new[None], a.latent[None])
        if layers[-1].index is not None:
            layers[-1].index.append(new_index_keys)
        write_back(call.states, module.layer_idx)
    if walk is not None and walk.end <= own.latent.end:  # this rank's rows, seeded by what its shard holds
        lo, hi = call.start, walk.end
        call.states[-1].seeds.append(((a.k_new,), lambda: (own.latent.own_grads(lo, hi)[0][0],)))
    elif call.records_roots() and call.start + t <= own.latent.end:
        read = seed_reader(own.latent, call.start, call.start + t, parts=1, device=k_new.device,
                           stager=stager_of(call.states[-1], module.layer_idx))
        call.states[-1].seeds.append(((k_new,), lambda: (read()[0][0],)))  # dk [1, T, R + Dr] holds dv too


# ----------------------------------------------------------------------------
# context parallelism


def divided_mla(module, q_full, k_new, rank: int, topk, call, prev_indices, index_inputs):
    """Phase DIVIDED: absorbed MLA of this rank's positions: q_full [H, N, R + Dr], k_new [N, R + Dr] (latent
    | rope key; the value is its first R = `rank` columns). The rows (and, with
    index_inputs = (queries [N, Hi, Di], keys [N, Di], weights [N, Hi]), the indexer keys) go
    into the sharded state. Where some query sees more than `topk` positions the selection
    is DSA's global one (the layer's own indexer, or a GLM-5 "shared" layer's
    `prev_indices`). Returns (o_lat [H, N, R] in q_full's dtype, indices [N, K] or None)."""
    d: Divided = call.divided
    layer = call.states[-1].layers[module.layer_idx]
    layer.latent.append_own(k_new[None], k_new[None, :, :rank], d.total)
    if index_inputs is not None:
        layer.index.append_own(index_inputs[1], d.total)
    deal = dict(positions=d.total, rank=d.rank, world=d.world, block=d.block, cp=d.cp, piece_rows=d.chunk_size)
    if topk is None or topk >= d.total:  # every query selects all it sees: dense
        return divided_causal_attention(q_full, k_new[None], None, scale=module.scaling, value_dim=rank, **deal), None
    if index_inputs is not None:
        index_q, keys, weights = index_inputs
        indices = divided_indexer_topk(index_q.float(), weights, keys, topk, scale=module.indexer.softmax_scale,
                                       **deal)
    else:
        indices = shared_selection(prev_indices)
    return divided_sparse_attention(q_full, k_new, indices, value_dim=rank, scale=module.scaling, **deal), indices


def gather_mla_chunk(q_full, k_new, index_inputs, call):
    """A divided reverse walk's MLA layer (exact mode): this rank's n rows of the chunk ->
    the whole chunk's T rows, in chunk order. q_full [H, n, R + Dr], k_new [n, R + Dr]
    (gathered with autograd, `DividedChunk.gather`: one all-gather for the two) and the
    indexer's inputs (queries [n, Hi, Di], keys [n, Di], weights [n, Hi], or None; gathered
    without grad, as the indexer runs) -> (q_full [H, T, R + Dr], k_new [T, R + Dr], index_inputs
    of T rows).

    The chunk's attention then runs as in the replicated walk (`_mla_chunk`): the
    DSA selection and sparse attention's own causal part on every rank (a dense layer's
    causal part divided by query rows, `own_rows`), the part over earlier chunks divided
    by the sharded state. `DividedChunk.own_rows` keeps this rank's rows of its output;
    the projections around it, the MoE and o_proj run on this rank's rows only."""
    d: DividedChunk = call.divided
    h = q_full.shape[0]
    both = d.gather(torch.cat([q_full, k_new[None]]))  # (H + 1, T, R + Dr)
    if index_inputs is not None:
        queries, keys, weights = index_inputs
        n, hi, di = queries.shape
        with torch.no_grad():
            qk = d.gather(torch.cat([queries.reshape(n, hi * di), keys], 1))  # (T, Hi Di + Di)
            index_inputs = (qk[:, : hi * di].reshape(-1, hi, di), qk[:, hi * di:], d.gather(weights))
    return both[:h], both[h], index_inputs


def routed_mla(modules, specs):
    """Within the block, each MLA attention module in `modules` runs `mla_forward`."""
    return forwards_replaced(modules, [functools.partial(mla_forward, m, spec) for m, spec in zip(modules, specs)])


class MLAAdapter(Adapter):
    model_types = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
    batches_replay = True
    divides_capture = True
    divides_walk = True

    def check_config(self) -> None:
        model_type = self.config.model_type
        self.attn_modules = [layer.self_attn for layer in self.backbone.layers]
        self.specs = []
        for i, attn in enumerate(self.attn_modules):
            if not hasattr(attn, "kv_a_proj_with_mqa") or not hasattr(attn, "kv_b_proj"):
                raise UnsupportedModelError(f"layer {i}: {type(attn).__name__} is not an MLA attention module")
            check_dense_weight(attn.kv_b_proj, f"layer {i}")
            check_affine(attn.kv_b_proj, f"layer {i} kv_b_proj")
            main_rope, index_rope = _rope_functions(attn, model_type)
            shared = model_type == "glm_moe_dsa" and getattr(attn, "indexer", None) is None
            if shared and i == 0:
                raise UnsupportedModelError("the first GLM-5 layer must run its own indexer (indexer_types[0])")
            self.specs.append(dict(rope=main_rope, index_rope=index_rope,
                                   shared_topk=self.config.index_topk if shared else None,
                                   returns_topk=model_type == "glm_moe_dsa"))

    def check_runnable(self) -> None:
        super().check_runnable()
        for i, attn in enumerate(self.attn_modules):  # an adapter may have been added since construction
            check_affine(attn.kv_b_proj, f"layer {i} kv_b_proj")

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        layers = []
        device = HOST if host else self.device
        for attn in self.attn_modules:
            latent = LatentKV.empty_latent(rank=attn.kv_lora_rank, rope_dim=attn.qk_rope_head_dim, capacity=positions,
                                           start=start, dtype=self.dtype, device=device, shard=shard)
            index = None
            if getattr(attn, "indexer", None) is not None:
                index = IndexKeys.empty(capacity=positions, dim=attn.indexer.head_dim, start=start, dtype=self.dtype,
                                        device=device, shard=shard)
            layers.append(MLAState(latent=latent, index=index))
        return PromptState(layers=layers, start=start)

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        start = prompt.start + prompt.length
        layers = []
        for attn in self.attn_modules:
            index = getattr(attn, "indexer", None)
            layers.append(BranchLatent.empty(branches=branches, width=attn.kv_lora_rank + attn.qk_rope_head_dim,
                                             index_dim=None if index is None else index.head_dim, capacity=capacity,
                                             start=start, dtype=self.dtype, device=self.device,
                                             rank=attn.kv_lora_rank))
        return BranchState(layers=layers, branches=branches, start=start)

    def routing(self):
        return routed_mla(self.attn_modules, self.specs)
