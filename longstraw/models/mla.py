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
"""

from __future__ import annotations

import functools
import sys

import torch

from ..errors import UnsupportedModelError
from longstraw.state.offload import restage_on_backward, staged_layers, stager_of, write_back
from ..ops.attention import prefix_causal_attention
from longstraw.state.branch import BranchLatent, BranchState
from longstraw.state.prompt import HOST, IndexKeys, LatentKV, MLAState, PromptState
from .attention_hook import current_call, seed_reader
from .peft_layers import check_affine, effective_affine
from .base import Adapter, forwards_replaced
from .divided import divided_mla, gather_mla_chunk, own_chunk_rows
from .mla_decode import mla_decode, prompt_candidates


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
    `own` (a divided walk's (index, cp)): see `_select_across_ranks`."""
    from ..ops.dsa import indexer_topk

    held = [layer.index for layer in layers if layer.index is not None]
    if any(ix.shard is not None for ix in held):
        return _select_across_ranks(indexer, q, keys, weights, call, held, own=own)
    segments = [(ix.until(call.start), ix.start) for ix in held]  # scored in fp32 block by block, never copied whole
    with torch.no_grad():
        return indexer_topk(q.float(), weights, segments, keys, call.start, indexer.index_topk,
                            scale=indexer.softmax_scale)


@torch.no_grad()
def _select_across_ranks(indexer, q, keys, weights, call, held, query_block: int = 128, own=None):
    """Context parallelism: the same global selection as one process. Each rank takes the
    top-k of its own shard of the prompt's indexer keys; an all-gather collects every
    rank's candidates (positions and scores); the replicated keys (a branch's earlier
    pieces, the new tokens) add theirs; the top-k of that union, by the same order
    (score, then lower position), is the global top-k, since every member of the global
    top-k is in its own shard's top-k.

    `own` = (index, cp) (a divided walk; index[s] the query rows rank s owns): the shard
    candidates are still taken for every query (each rank's shard serves all of them),
    but each rank scores the replicated keys and merges only for its own rows, and the
    rows' selections are then gathered (one all-gather of [n, K] positions)."""
    from longstraw.parallel.collectives import gather_rows
    from ..ops.dsa import indexer_scores, select_candidates

    topk, scale, t = indexer.index_topk, indexer.softmax_scale, q.shape[0]
    shard_ix = next(ix for ix in held if ix.shard is not None)
    others = [ix for ix in held if ix.shard is None]
    rep_keys = torch.cat([ix.until(call.start) for ix in others] + [keys])
    rep_pos = torch.cat([ix.positions(call.start) for ix in others]
                        + [torch.arange(call.start, call.start + t, device=q.device)])
    mine = torch.ones(t, dtype=torch.bool, device=q.device)
    if own is not None:
        mine = torch.zeros_like(mine).index_fill_(0, own[0][own[1].rank], True)
    out = torch.full((t, topk), -1, dtype=torch.long, device=q.device)
    for b0 in range(0, t, query_block):
        b1 = min(t, b0 + query_block)
        qb, wb = q[b0:b1].float(), weights[b0:b1]
        shard_pos, shard_sc = prompt_candidates(qb, wb, shard_ix, call.start, topk, scale)  # every rank's, gathered
        rows = torch.nonzero(mine[b0:b1])[:, 0]  # the block's rows this rank selects for
        if rows.numel() == 0:
            continue
        seen = rep_keys.shape[0] - t + b1  # rep_pos increases: the block's last query sees this many
        rep_sc = indexer_scores(qb[rows], wb[rows], rep_keys[:seen], scale=scale)  # (b, seen)
        query_pos = call.start + b0 + rows
        visible = rep_pos[None, :seen] <= query_pos[:, None]
        cand_pos = torch.cat([shard_pos[rows], torch.where(visible, rep_pos[None, :seen], -1)], dim=1)
        cand_sc = torch.cat([shard_sc[rows], rep_sc], dim=1)
        out[b0 + rows] = select_candidates(cand_sc, cand_pos, topk)
    if own is not None:  # (positions as int32 on the wire)
        out = gather_rows(out[own[0][own[1].rank]].to(torch.int32), own[0], own[1]).long()
    return out


def _sparse_attention(q_full, k_new, latent, indices, latents, call, scale):
    """Gathered sparse attention over the selected rows of `latents` (the stacked states'
    `LatentKV`s) and the new tokens. With a context-parallel shard among them, each rank
    attends over the selected rows it holds, the partials are merged across ranks, and
    the replicated rows (a branch's earlier pieces, the new tokens) are merged in after.
    Returns [H, T, R]."""
    from ..ops.flash import merge_partials
    from ..tensors import KVSegment
    from ..ops.dsa import sparse_latent_attention

    segments = [kv.segment(until=call.start) for kv in latents]
    sharded = [kv for kv in latents if kv.shard is not None]
    if not sharded:
        return sparse_latent_attention(q_full, k_new, latent, indices, prefixes=segments, q_start=call.start,
                                       scale=scale)
    from longstraw.parallel.context import MergeAcrossRanks, SumGradAcrossRanks

    kv = sharded[0]
    seg, shard = kv.segment(until=call.start), kv.shard
    safe = indices.clamp(min=0)
    in_shard = (indices >= kv.start) & (indices < min(kv.end, call.start))
    rows = shard.count_tensor(safe) - shard.count(kv.start)  # local row of an owned position
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


def mla_forward(module, spec, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                position_ids=None, prev_topk_indices=None, **kwargs):
    """Drop-in for an MLA attention module's forward: hidden_states [1, T, d] ->
    [1, T, d] (and, for GLM-5, the top-k indices the next "shared" layer reuses).
    `spec` holds the family's RoPE functions and DSA layout (see `MLAAdapter`)."""
    call = current_call()
    decode = call.phase == "decode"
    indexer = getattr(module, "indexer", None)
    # (T, d); decode: the G branches' tokens, all at one position, run as one sequence of G
    x = hidden_states[:, 0] if decode else hidden_states[0]
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
    cos, sin = position_embeddings
    if decode:  # [G, 1, Dr] at one position -> [1, G, Dr]
        cos, sin = cos[:, 0][None], sin[:, 0][None]
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

    layers: list[MLAState] = staged_layers(call.states, module.layer_idx, call.start)  # offloaded: in a slot
    topk = indexer.index_topk if indexer is not None else spec["shared_topk"]
    if decode:
        assert len(layers) == 1, "decode reads one prompt state"
        index_inputs = None
        if indexer is not None:
            index_inputs = _indexer_inputs(indexer, x, q_resid, cos, sin, spec["index_rope"])
        o_lat, indices = mla_decode(q_full.transpose(0, 1), k_new, call.branches.layers[module.layer_idx], layers[0],
                                    position=call.start, scale=module.scaling, rank=rank, block_size=call.block_size,
                                    topk=topk, index_inputs=index_inputs,
                                    index_topk_scale=None if indexer is None else indexer.softmax_scale,
                                    prev_indices=prev_topk_indices)  # (G, H, R)
        out = torch.einsum("ghr,hvr->ghv", o_lat, w_uv)  # (G, H, Dv)
        out = module.o_proj((out if b_uv is None else out + b_uv).reshape(t, 1, h * vdim))
        return (out, None, indices) if spec["returns_topk"] else (out, None)
    indices, new_index_keys, index_inputs, own_k = None, None, None, k_new
    if indexer is not None:
        index_inputs = _indexer_inputs(indexer, x, q_resid, cos, sin, spec["index_rope"])
    walk_divided = call.phase == "recompute" and call.divided is not None
    if walk_divided:  # a divided reverse walk: the whole chunk's rows from every rank (`divided.py`)
        q_full, k_new, index_inputs = gather_mla_chunk(q_full, k_new, index_inputs, call)
        latent = k_new[:, :rank]
    if index_inputs is not None:
        index_q, new_index_keys, index_w = index_inputs
    if call.phase == "divided":  # context parallelism: this rank's own positions (`divided.py`)
        o_lat, indices = divided_mla(module, q_full, k_new, rank, topk, call, prev_topk_indices, index_inputs)
    elif topk is not None and topk < call.start + k_new.shape[0]:  # some query sees more than top-k positions
        if indexer is not None:  # a divided walk selects for its own rows (`_select_across_ranks`)
            own_rows = (call.divided.rows(x.device), call.divided.cp) if walk_divided else None
            indices = _select(indexer, layers, index_q, new_index_keys, index_w, call, own=own_rows)
        else:
            indices = prev_topk_indices
            assert indices is not None, "a shared DSA layer needs the previous layer's selection"
        o_lat = _sparse_attention(q_full, k_new, latent, indices, [layer.latent for layer in layers], call,
                                  module.scaling)
    else:  # every query selects all it sees: dense (the indexer keys are still kept)
        segments = [layer.latent.segment(until=call.start) for layer in layers]
        own_rows = (call.divided.rows(q_full.device), call.divided.cp) if walk_divided else None  # self part divided
        o_lat = prefix_causal_attention(q_full, k_new[None], latent[None], prefixes=segments, q_start=call.start,
                                        scale=module.scaling, block_size=call.block_size, own_rows=own_rows)
    if walk_divided:
        o_lat = own_chunk_rows(o_lat, call)  # (H, t, R)
    o_lat = restage_on_backward(o_lat, call.states, module.layer_idx, call.start)
    out = torch.einsum("htr,hvr->thv", o_lat, w_uv)  # (T, H, Dv)
    out = module.o_proj((out if b_uv is None else out + b_uv).reshape(1, t, h * vdim))

    own = call.states[-1].layers[module.layer_idx]  # the state itself (host rows when offloaded)
    if call.phase == "capture":
        layers[-1].latent.append(k_new[None], latent[None])
        if layers[-1].index is not None:
            layers[-1].index.append(new_index_keys)
        write_back(call.states, module.layer_idx)
    if walk_divided and call.divided.end <= own.latent.end:  # this rank's rows, seeded by what its shard holds
        a, b = call.start, call.divided.end
        call.states[-1].seeds.append(((own_k,), lambda: (own.latent.own_grads(a, b)[0][0],)))
    elif call.records_roots() and call.start + t <= own.latent.end:
        read = seed_reader(own.latent, call.start, call.start + t, parts=1, device=k_new.device,
                           stager=stager_of(call.states[-1], module.layer_idx))
        call.states[-1].seeds.append(((k_new,), lambda: (read()[0][0],)))  # dk [1, T, R + Dr] holds dv too
    return (out, None, indices) if spec["returns_topk"] else (out, None)


def routed_mla(modules, specs):
    """Within the block, each MLA attention module in `modules` runs `mla_forward`."""
    return forwards_replaced(modules, [functools.partial(mla_forward, m, spec) for m, spec in zip(modules, specs)])


class MLAAdapter(Adapter):
    model_types = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
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
                                             start=start, dtype=self.dtype, device=self.device))
        return BranchState(layers=layers, branches=branches, start=start)

    def routing(self):
        return routed_mla(self.attn_modules, self.specs)
