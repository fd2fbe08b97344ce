"""Kimi Linear (`kimi_linear`): Kimi Delta Attention (KDA) layers with a few MLA layers
between them, MoE blocks, in every phase, context parallelism included.

KDA is Gated DeltaNet with a decay per key channel (`ops/kda.py`). Its state is a
constant-size `RecurrentState`: the recurrent state [H, Dk, Dv] (float32; float64 for
float64 models) and one conv tail [3 * H * Dk, K-1] (HF runs one depthwise conv over
[q | k | v]). As for GDN (`gated_deltanet.py`, whose phases and snapshot rules this
module follows), HF's KDA forward writes its cache in place, so inside `routed_kda`
each KDA module's `forward` is replaced on the instance by `kda_forward`. It calls the
module's own q/k/v projections, conv weight, `forget_gate` module (f_a_proj, f_b_proj,
dt_bias, A_log: the log decay g [T, H, Dk]), b_proj (beta = sigmoid), g_a/g_b gate
projections, gated `o_norm` and o_proj, with our `causal_conv1d_with_tail` and
`chunk_kda` from the snapshot at `start`.

The MLA layers are `mla.py`'s, state and all (`MLAState`: one latent row
[kv_lora_rank + qk_rope_head_dim] per position). Kimi's MLA is NoPE: HF deletes the
rotary module, and the "rope" half of the query and the shared key are used unrotated,
so the spec passes no RoPE function (`mla.absorb` then skips it).

Context parallelism: a divided capture gives each own segment its conv tail from the
previous block's owner, its affine transition (`ops/kda.kda_transition`), a relay of
the state across ranks and snapshots summed from their owners; a divided reverse walk
projects this rank's rows (the forget gate included), gathers the chunk's rows, and
runs the conv and the scan over the whole chunk on every rank, keeping its own rows.

Shapes: T tokens (N / n: this rank's own), C = 3 * H * Dk conv channels, H heads,
Dk = Dv = linear_head_dim, K the conv kernel, G branches.
"""

from __future__ import annotations

import contextlib

import torch

from longstraw.errors import UnsupportedModelError
from longstraw.ops.causal_conv import causal_conv1d_step, causal_conv1d_with_tail
from longstraw.ops.gated_delta_scan import chain_states, finish_outputs
from longstraw.ops.kda import chunk_kda, kda_step, kda_transition
from longstraw.parallel.collectives import GradOnFirstRank
from longstraw.state.branch import BranchLatent, BranchRecurrent, BranchState
from longstraw.state.prompt import HOST, LatentKV, MLAState, PromptState, RecurrentState

from .base import Adapter
from .gated_deltanet import block_tails, initial_snapshot, keep_snapshot, share_snapshots, tail_before
from .mla import check_dense_weight, routed_mla
from .peft_layers import check_affine
from .routing import AttentionCall, Divided, DividedChunk, current_call, forwards_replaced

KDA_CHUNK = 64
"""Tokens per chunk of the KDA scan (any size gives the same result up to rounding)."""


def _project(module, x):
    """(mixed [T, C] = [q | k | v] before the conv, g [T, H, Dk] the log decay, beta
    logits [T, H]) from x [T, d]: the module's own projections and forget gate."""
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    g = module.forget_gate(x[None])[0]  # (T, H, Dk), HF's float32
    return mixed, g, module.b_proj(x)


def _split(module, conv):
    """q, k, v [T, H, D] from the post-conv features conv [T, C]."""
    t = conv.shape[0]
    return tuple(y.reshape(t, module.num_heads, module.head_dim) for y in conv.split([module.qkv_dim] * 3, dim=-1))


def _conv(module, mixed, tail, weight=None):
    """The short conv of mixed [T, C] after `tail` [C, K-1] -> (features [T, C], new tail)."""
    weight = module.conv1d.weight if weight is None else weight
    conv, tail = causal_conv1d_with_tail(mixed.transpose(0, 1), weight[:, 0, :], module.conv1d.bias, tail,
                                         activation=module.activation)
    return conv.transpose(0, 1), tail


def _gated_output(module, out, x):
    """The module's gated o_norm and o_proj: out [T, H, Dv] (x [T, d] the layer's input,
    for the gate) -> [T, d]."""
    t = x.shape[0]
    gate = module.g_b_proj(module.g_a_proj(x)).view(t, module.num_heads, module.head_dim)
    return module.o_proj(module.o_norm(out.to(x.dtype), gate).reshape(t, -1))


def kda_forward(module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Drop-in for a KDA module's forward: hidden_states [1, T, d] -> [1, T, d]
    (phase DECODE: [G, 1, d] -> [G, 1, d])."""
    call = current_call()
    run = call.route(chunk=_chunk, decode=_decode, divided=divided_kda, divided_walk=divided_recompute_kda)
    return run(module, hidden_states, call)


def _chunk(module, hidden_states, call: AttentionCall):
    """Phases CAPTURE, REPLAY, RECOMPUTE: [1, T, d] at positions start.. -> [1, T, d]."""
    x = hidden_states[0]  # (T, d)
    mixed, g, beta_logit = _project(module, x)
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, call.start, x.device)
    conv, tail1 = _conv(module, mixed, tail0)
    q, k, v = _split(module, conv)
    out, rec1 = chunk_kda(q, k, v, g, beta_logit.sigmoid(), rec0, chunk_size=KDA_CHUNK, use_qk_l2norm=True)
    out = _gated_output(module, out, x)

    keep_snapshot(call, module.layer_idx, call.start + x.shape[0], rec1, tail1)
    return out[None]


def _decode(module, hidden_states, call: AttentionCall):
    """Phase DECODE, one token per branch: [G, 1, d] -> [G, 1, d], stepping the
    branches' own states and conv tails (`BranchRecurrent`)."""
    own: BranchRecurrent = call.branches.layers[module.layer_idx]
    x = hidden_states[:, 0]  # (G, d): the projections are per token
    mixed, g, beta_logit = _project(module, x)
    state, tail = own.state(call.rows)
    conv, tail = causal_conv1d_step(mixed, module.conv1d.weight[:, 0, :], module.conv1d.bias, tail,
                                    activation=module.activation)  # (G, C)
    q, k, v = _split(module, conv)
    out, state = kda_step(q, k, v, g, beta_logit.sigmoid(), state, use_qk_l2norm=True)  # (G, H, Dv)
    own.update(state, tail, call.rows)
    return _gated_output(module, out, x)[:, None]


# ----------------------------------------------------------------------------
# context parallelism


def divided_kda(module, hidden_states, call: AttentionCall):
    """Phase DIVIDED: [1, N, d] of this rank's positions -> [1, N, d] (module docstring)."""
    d: Divided = call.divided
    x = hidden_states[0]  # (N, d)
    mixed, g, beta_logit = _project(module, x)
    width = module.conv1d.weight.shape[-1] - 1
    table = block_tails(mixed, d, width)
    segments = d.segments()
    parts, transitions, links, ends = [], [], [], {}
    for s, e in segments:
        r0, r1 = d.local_row(s), d.local_row(s) + (e - s)
        conv, ends[e] = _conv(module, mixed[r0:r1], tail_before(s, mixed, table, d, width))
        q, k, v = _split(module, conv)
        read, out0, a, c = kda_transition(q, k, v, g[r0:r1], beta_logit[r0:r1].sigmoid(), chunk_size=KDA_CHUNK)
        parts.append((read, out0))
        transitions.append((a, c))
        links.append((-1 if s == 0 else d.owner(s - 1), d.owner(e) if e < d.total and d.owner(e) != d.rank else None))
    shape = (module.num_heads, module.head_dim, module.head_dim)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    chained = chain_states(transitions, links, d.cp, shape, acc, x.device)
    outs = [finish_outputs(read, out0, start) for (read, out0), (start, _) in zip(parts, chained)]
    out = torch.cat(outs) if outs else x.new_zeros(0, module.num_heads, module.head_dim, dtype=acc)
    share_snapshots(call.states[-1].layers[module.layer_idx], d, {e: end for (_, e), (_, end) in zip(segments, chained)},
                    ends, shape, acc, mixed.new_zeros(mixed.shape[1], width))
    return _gated_output(module, out, x)[None]


def divided_recompute_kda(module, hidden_states, call: AttentionCall):
    """A divided reverse walk's KDA layer (exact mode): [1, n, d] of this rank's n
    positions of the chunk -> [1, n, d]. As `gated_deltanet.divided_recompute_gdn`: the
    projections (the forget gate's included: it is per token) and the gated norm +
    o_proj run on this rank's rows; the conv and the scan run over the whole chunk on
    every rank (gathered rows), and this rank keeps its rows. The conv weight, the one
    replicated parameter, passes its gradient on the first rank only."""
    d: DividedChunk = call.divided
    x = hidden_states[0]  # (n, d)
    mixed, g, beta_logit = _project(module, x)
    n, c = mixed.shape
    rows = torch.cat([mixed.to(g.dtype), beta_logit.to(g.dtype), g.reshape(n, -1)], 1)  # upcast: lossless
    full = d.gather(rows)  # (T, C + H + H Dk)
    full_mixed = full[:, :c].to(mixed.dtype)
    full_beta = full[:, c:c + module.num_heads].to(beta_logit.dtype)
    full_g = full[:, c + module.num_heads:].reshape(-1, module.num_heads, module.head_dim)
    weight = GradOnFirstRank.apply(module.conv1d.weight, d.cp)
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, d.start, x.device)
    conv, tail1 = _conv(module, full_mixed, tail0, weight)
    q, k, v = _split(module, conv)
    out, rec1 = chunk_kda(q, k, v, full_g, full_beta.sigmoid(), rec0, chunk_size=KDA_CHUNK, use_qk_l2norm=True)
    out = d.own_rows(out, rows_dim=0)  # (n, H, Dv)
    keep_snapshot(call, module.layer_idx, d.end, rec1, tail1)
    return _gated_output(module, out, x)[None]


def routed_kda(modules):
    """Within the block, each KDA module in `modules` runs `kda_forward`."""
    return forwards_replaced(modules, [kda_forward.__get__(m) for m in modules])


# ----------------------------------------------------------------------------
# the adapter


def is_kda(layer) -> bool:
    """Whether a Kimi Linear decoder layer's mixer is KDA (else MLA)."""
    return getattr(layer, "block_type", None) == "linear_attention"


class KimiLinearAdapter(Adapter):
    model_types = ("kimi_linear",)
    divides_capture = True
    divides_walk = True
    restarts_at_chunks = True  # its KDA layers recompute from the snapshots at capture-chunk starts

    def check_config(self) -> None:
        layers = self.backbone.layers
        self.kda_modules = [layer.self_attn for layer in layers if is_kda(layer)]
        self.mla_modules = [layer.self_attn for layer in layers if not is_kda(layer)]
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            if is_kda(layer) and not hasattr(attn, "forget_gate"):
                raise UnsupportedModelError(f"layer {i}: {type(attn).__name__} is not a Kimi Delta Attention module")
            if not is_kda(layer):
                if not hasattr(attn, "kv_a_proj_with_mqa"):
                    raise UnsupportedModelError(f"layer {i}: {type(attn).__name__} is not an MLA attention module")
                check_dense_weight(attn.kv_b_proj, f"layer {i}")
                check_affine(attn.kv_b_proj, f"layer {i} kv_b_proj")
        if getattr(self.backbone, "rotary_emb", None) is not None:
            raise UnsupportedModelError("Kimi Linear's MLA is NoPE, but this model has a rotary module; LongStraw "
                                        "would leave its keys unrotated")
        # NoPE MLA: no rope function; DSA: none
        self.specs = [dict(rope=None, index_rope=None, shared_topk=None, returns_topk=False)] * len(self.mla_modules)

    def check_runnable(self) -> None:
        super().check_runnable()
        for i, attn in enumerate(self.mla_modules):  # an adapter may have been added since construction
            check_affine(attn.kv_b_proj, f"MLA layer {i} kv_b_proj")

    def new_state(self, positions: int, *, start: int = 0, exact: bool = False, shard=None,
                  host: bool = False) -> PromptState:
        layers = []
        for layer in self.backbone.layers:
            attn = layer.self_attn
            if is_kda(layer):
                layers.append(RecurrentState.empty(start=start, keep_all=exact))
                continue
            latent = LatentKV.empty_latent(rank=attn.kv_lora_rank, rope_dim=attn.qk_rope_head_dim, capacity=positions,
                                           start=start, dtype=self.dtype, device=HOST if host else self.device,
                                           shard=shard)
            layers.append(MLAState(latent=latent, index=None))
        return PromptState(layers=layers, start=start)

    def new_branch_state(self, prompt: PromptState, branches: int, capacity: int) -> BranchState:
        start = prompt.start + prompt.length
        layers = []
        for layer, held in zip(self.backbone.layers, prompt.layers):
            attn = layer.self_attn
            if is_kda(layer):
                layers.append(BranchRecurrent.from_snapshot(held.snapshots[start], branches, start))
            else:
                layers.append(BranchLatent.empty(branches=branches, width=attn.kv_lora_rank + attn.qk_rope_head_dim,
                                                 index_dim=None, capacity=capacity, start=start, dtype=self.dtype,
                                                 device=self.device, rank=attn.kv_lora_rank))
        return BranchState(layers=layers, branches=branches, start=start)

    @contextlib.contextmanager
    def routing(self):
        with routed_kda(self.kda_modules), routed_mla(self.mla_modules, self.specs):
            yield
