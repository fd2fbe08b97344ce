"""Gated DeltaNet layers (Qwen3.5 / Qwen3.6, Qwen3-Next) in every phase, context
parallelism included, on LongStraw's own state.

HF's GDN forward reads and writes its cache with in-place `copy_`, which breaks
autograd in branch replay, so we never hand it a cache. Instead, inside `routed_gdn`,
each GDN module's `forward` is replaced (on the instance, for the duration only) by
`gdn_forward`, which calls the module's own projections, conv weight, gates, gated
norm and output projection, and our `causal_conv1d_with_tail` and
`chunk_gated_delta_rule`, starting from the snapshot in LongStraw's `RecurrentState`.

Per phase (`routing.Phase`):
    CAPTURE    start from the snapshot at `start`, record the snapshot at the end
    REPLAY     start from the snapshot at `start`, record nothing
    RECOMPUTE  start from the snapshot as a leaf that requires grad when its owner
               tracks gradients (a hook adds dL/dsnapshot into the owner); seed the
               end state with the gradient accumulated for it, if any
    DECODE     one token for each of G branches: step each branch's own copy of the
               state (`BranchRecurrent`) with the recurrent form of the rule
    DIVIDED    context parallelism's divided capture (`divided_gdn`): each own segment
               (a block, cut at the snapshot positions) gets its conv tail from the
               previous block's owner (one all-gather of every block's last K-1 pre-conv
               rows), then its affine transition (`ops/gated_delta_scan.py`); a relay
               across ranks carries the recurrent state from segment to segment; each
               rank finishes its outputs, and the snapshots every rank needs (the end;
               exact mode: every chunk start) are summed over ranks from their owners
    RECOMPUTE of a divided reverse walk (`divided_recompute_gdn`): this rank's rows are
               projected, the chunk's projected rows gathered, the conv and the
               recurrence run over the whole chunk on every rank, and this rank keeps
               its rows

Shapes: T tokens (N: this rank's own in a divided capture; n: its own of a walk chunk),
C = conv_dim, Hv value heads, Dk / Dv head dims, K the conv kernel, G branches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.ops.causal_conv import causal_conv1d_step, causal_conv1d_with_tail
from longstraw.ops.gated_delta import chunk_gated_delta_rule, gated_delta_step
from longstraw.ops.gated_delta_scan import chain_states, finish_outputs, gated_delta_transition
from longstraw.parallel.collectives import GradOnFirstRank, all_gather, all_reduce_sum
from longstraw.state.branch import BranchRecurrent
from longstraw.state.prompt import RecurrentState

from .routing import AttentionCall, Divided, DividedChunk, Phase, current_call, forwards_replaced

def initial_snapshot(states, layer_idx: int, position: int, device=None):
    """(recurrent, conv_tail) at `position`, found in the stacked states (latest first),
    on `device` (staged from host memory if the snapshot was offloaded there: exact
    mode's `ExecConfig.offload_snapshots`). Where the owner tracks gradients and grad is
    on, they are fresh leaves whose gradient is added into the owner's `grads[position]`."""
    for state in reversed(states):
        layer: RecurrentState = state.layers[layer_idx]
        if position in layer.snapshots:
            pair = layer.get(position, device)
            if layer.grads is None or not torch.is_grad_enabled():
                return pair
            out = []
            for which, t in enumerate(pair):
                if t is None:
                    out.append(None)
                    continue
                leaf = t.detach().requires_grad_()
                leaf.register_hook(lambda g, layer=layer, which=which: layer.add_grad(position, which, g))
                out.append(leaf)
            return tuple(out)
    raise AssertionError(f"layer {layer_idx}: no recurrent snapshot at position {position}")


def keep_snapshot(call: AttentionCall, layer_idx: int, end: int, recurrent, conv_tail) -> None:
    """After a run of the layer up to position `end`: a capture records the snapshot there;
    a recompute (or a capture that keeps its graph, or a divided walk's chunk) records
    (recurrent, conv_tail) as roots of the chunk's graph, seeded by the gradient later
    readers of that snapshot accumulated."""
    layer: RecurrentState = call.states[-1].layers[layer_idx]
    if call.phase is Phase.CAPTURE:
        layer.put(end, recurrent, conv_tail)
    if call.records_roots() and layer.grads is not None:
        call.states[-1].seeds.append(((recurrent, conv_tail), lambda: layer.take_grad(end)))


def _project(module, x):
    """(mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) from x [T, d],
    with each family's own projection layout."""
    t = x.shape[0]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: grouped per key head
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None]))
        mixed = torch.cat([y.reshape(1, t, -1) for y in (q, k, v)], dim=-1)[0]
        return mixed, z[0], b[0], a[0]
    mixed = module.in_proj_qkv(x)  # Qwen3.5 / 3.6: flat [q | k | v]
    z = module.in_proj_z(x).reshape(t, -1, module.head_v_dim)
    return mixed, z, module.in_proj_b(x), module.in_proj_a(x)


def _split_heads(module, conv):
    """q, k [N, Hk, Dk] and v [N, Hv, Dv] from the post-conv features conv [N, conv_dim]."""
    n = conv.shape[0]
    q, k, v = torch.split(conv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (q.reshape(n, -1, module.head_k_dim), k.reshape(n, -1, module.head_k_dim),
            v.reshape(n, -1, module.head_v_dim))


def _log_decay(module, a, params=None):
    """The rule's log decay g [N, Hv] (<= 0) from the `a` projection, as HF computes it
    (`params`: (A_log, dt_bias) to use instead of the module's own)."""
    a_log, dt_bias = (module.A_log, module.dt_bias) if params is None else params
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias)


def _gated_output(module, out, z, shape):
    """The module's gated norm and output projection: out, z [N, Hv, Dv] -> [*shape, d]."""
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(*shape, -1))


def gdn_forward(module, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Drop-in for a GDN module's forward: hidden_states [1, T, d] -> [1, T, d]
    (phase DECODE: [G, 1, d] -> [G, 1, d])."""
    call = current_call()
    run = call.route(chunk=_gdn_chunk, decode=_gdn_decode, divided=divided_gdn, divided_walk=divided_recompute_gdn)
    return run(module, hidden_states, call)


def _gdn_chunk(module, hidden_states, call: AttentionCall):
    """Phases CAPTURE, REPLAY, RECOMPUTE: hidden_states [1, T, d] at positions start.. ->
    [1, T, d], from the snapshot at `start` (REPLAY of a batch [B, T, d]: `_gdn_batch`)."""
    if hidden_states.shape[0] > 1:
        return _gdn_batch(module, hidden_states, call)
    x = hidden_states[0]  # (T, d)
    t = x.shape[0]
    mixed, z, b, a = _project(module, x)
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, call.start, x.device)
    weight = module.conv1d.weight[:, 0, :]  # (conv_dim, K)
    conv, tail1 = causal_conv1d_with_tail(mixed.transpose(0, 1), weight, module.conv1d.bias, tail0,
                                          activation=module.activation)  # (conv_dim, T)
    q, k, v = _split_heads(module, conv.transpose(0, 1))
    out, rec1 = chunk_gated_delta_rule(q, k, v, _log_decay(module, a), b.sigmoid(), rec0,
                                       use_qk_l2norm=True)  # (T, Hv, Dv)
    out = _gated_output(module, out, z, (1, t))

    keep_snapshot(call, module.layer_idx, call.start + t, rec1, tail1)
    return out


def _fold(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows [B*T, H, ...] of B branches -> [T, B*H, ...]: the branches as more heads."""
    t = x.shape[0] // batch
    return x.reshape(batch, t, *x.shape[1:]).transpose(0, 1).reshape(t, batch * x.shape[1], *x.shape[2:])


def _gdn_batch(module, hidden_states, call: AttentionCall):
    """Phase REPLAY of B branches at once (batched replay): hidden_states [B, T, d] ->
    [B, T, d], every branch from the same snapshot at `start`, expanded over the batch
    (its gradient, where it has an owner, is the branches' sum). The projections and the
    gated norm run on the B*T rows; the conv and the rule see the branches as B times the
    channels and heads (value head b*Hv + i reads q/k head b*Hk + i // (Hv / Hk), HF's
    grouping within each branch)."""
    assert call.phase is Phase.REPLAY, "a batch of branches is replay's"
    bsz, t, _ = hidden_states.shape
    mixed, z, b, a = _project(module, hidden_states.reshape(bsz * t, -1))  # (B*T, C), (B*T, Hv, Dv), (B*T, Hv) x2
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, call.start, hidden_states.device)
    c = mixed.shape[1]
    weight = module.conv1d.weight[:, 0, :]  # (C, K)
    bias = None if module.conv1d.bias is None else module.conv1d.bias.repeat(bsz)
    conv, _ = causal_conv1d_with_tail(mixed.reshape(bsz, t, c).transpose(1, 2).reshape(bsz * c, t),
                                      weight.repeat(bsz, 1), bias, None if tail0 is None else tail0.repeat(bsz, 1),
                                      activation=module.activation)  # (B*C, T)
    q, k, v = _split_heads(module, conv.reshape(bsz, c, t).transpose(1, 2).reshape(bsz * t, c))
    hv = v.shape[1]
    rec0 = None if rec0 is None else rec0.expand(bsz, *rec0.shape).reshape(bsz * hv, *rec0.shape[1:])
    out, _ = chunk_gated_delta_rule(_fold(q, bsz), _fold(k, bsz), _fold(v, bsz), _fold(_log_decay(module, a), bsz),
                                    _fold(b.sigmoid(), bsz), rec0, use_qk_l2norm=True)  # (T, B*Hv, Dv)
    out = out.reshape(t, bsz, hv, -1).transpose(0, 1).reshape(bsz * t, hv, -1)
    return _gated_output(module, out, z, (bsz, t))


def _gdn_decode(module, hidden_states, call: AttentionCall):
    """Phase DECODE, one token per branch: hidden_states [G, 1, d] -> [G, 1, d], stepping
    the branches' own recurrent states and conv tails (`BranchRecurrent`). The projections
    see the G tokens as a sequence of G (they are per-token); the conv and the rule are
    per branch."""
    own: BranchRecurrent = call.branches.layers[module.layer_idx]
    x = hidden_states[:, 0]  # (G, d)
    b = x.shape[0]
    mixed, z, beta_logit, a = _project(module, x)  # (G, conv_dim), (G, Hv, Dv), (G, Hv), (G, Hv)
    recurrent, tail = own.state(call.rows)  # the B branches `call.rows` (None: all G)
    conv, tail = causal_conv1d_step(mixed, module.conv1d.weight[:, 0, :], module.conv1d.bias, tail,
                                    activation=module.activation)  # (G, conv_dim)
    q, k, v = _split_heads(module, conv)
    out, recurrent = gated_delta_step(q, k, v, _log_decay(module, a), beta_logit.sigmoid(), recurrent,
                                      use_qk_l2norm=True)  # (G, Hv, Dv)
    own.update(recurrent, tail, call.rows)
    return _gated_output(module, out, z, (b, 1))


# ----------------------------------------------------------------------------
# context parallelism


def divided_recompute_gdn(module, hidden_states, call: AttentionCall):
    """A divided reverse walk's GDN layer (exact mode): hidden_states [1, n, d] of this
    rank's n positions of the chunk -> [1, n, d].

    The per-token parts are divided: the input projections and the gated norm + output
    projection run on this rank's rows. The conv and the recurrence run over the whole
    chunk on every rank (they need every earlier position's state, and cost little next
    to the projections): the chunk's projected rows of every rank are gathered
    (`DividedChunk.gather`), the rule starts from the snapshot at the chunk's start as in the
    replicated walk, and this rank keeps its output rows, whose gradient is summed over
    ranks (`DividedChunk.own_rows`). That replicated part's backward is then identical on
    every rank, seeds at the chunk's end and snapshot gradients included (the GDN state
    is replicated); its parameters (conv, A_log, dt_bias) pass their gradient on the
    first rank only (`GradOnFirstRank`), so the walk's one sum over ranks counts it once.

    The decay is computed per capture chunk, as the replicated walk computes it: HF's
    decay casts A_log to float32, so each call rounds A_log's gradient to float32 once,
    and cutting where the replicated walk cuts keeps that rounding the same."""
    d: DividedChunk = call.divided
    x = hidden_states[0]  # (n, d)
    mixed, z, b_logit, a_logit = _project(module, x)  # (n, C), (n, Hv, Dv), (n, Hv), (n, Hv)
    widths = [mixed.shape[1], b_logit.shape[1], a_logit.shape[1]]
    full_mixed, full_b, full_a = d.gather(torch.cat([mixed, b_logit, a_logit], 1)).split(widths, 1)  # (T, C|Hv|Hv)
    first = [None if p is None else GradOnFirstRank.apply(p, d.cp)
             for p in (module.conv1d.weight, module.conv1d.bias, module.A_log, module.dt_bias)]
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, d.start, x.device)
    conv, tail1 = causal_conv1d_with_tail(full_mixed.transpose(0, 1), first[0][:, 0, :], first[1], tail0,
                                          activation=module.activation)  # (C, T)
    q, k, v = _split_heads(module, conv.transpose(0, 1))
    assert d.start % d.chunk_size == 0, "a hybrid's walk chunk starts at a capture chunk"
    decay = torch.cat([_log_decay(module, full_a[i:i + d.chunk_size], (first[2], first[3]))
                       for i in range(0, full_a.shape[0], d.chunk_size)])  # (T, Hv)
    out, rec1 = chunk_gated_delta_rule(q, k, v, decay, full_b.sigmoid(), rec0,
                                       use_qk_l2norm=True)  # (T, Hv, Dv), the same on every rank
    out = d.own_rows(out, rows_dim=0)  # (n, Hv, Dv)
    keep_snapshot(call, module.layer_idx, d.end, rec1, tail1)  # the same on every rank
    return _gated_output(module, out, z, (1, x.shape[0]))


def block_tails(mixed: torch.Tensor, d: Divided, width: int) -> torch.Tensor:
    """Every block's last `width` pre-conv rows, all ranks: [blocks, width, C] (front zero
    padded for a block shorter than `width`), via one all-gather."""
    most = len(d.deal.blocks(0, d.total))  # the most blocks any rank owns (rank 0's)
    table = mixed.new_zeros(most, width, mixed.shape[1])  # (most, width, C): this rank's blocks, in order
    for i, (a, b, row) in enumerate(d.blocks()):
        m = min(width, b - a)
        table[i, width - m:] = mixed[row + (b - a) - m: row + (b - a)]
    gathered = [table] if d.world == 1 else all_gather(table, d.cp)
    firsts = range(0, d.total, d.block)  # every block's first position, in order
    if not firsts:
        return table[:0]
    return torch.stack([gathered[d.owner(p)][d.deal.row(p) // d.block] for p in firsts])


def tail_before(position: int, mixed, table, d: Divided, width: int) -> torch.Tensor:
    """The `width` pre-conv rows before `position`, [C, width] (zeros before the start)."""
    rows = []
    for p in range(position - width, position):
        if p < 0:
            rows.append(mixed.new_zeros(mixed.shape[1]))
        elif d.owner(p) == d.rank:
            rows.append(mixed[d.local_row(p)])
        else:  # in the last `width` rows of an earlier block
            end = min(d.total, (p // d.block + 1) * d.block)
            rows.append(table[p // d.block, width - (end - p)])
    return torch.stack(rows, dim=1) if rows else mixed.new_zeros(mixed.shape[1], 0)


def divided_gdn(module, hidden_states, call: AttentionCall):
    """Phase DIVIDED: hidden_states [1, N, d] of this rank's positions -> [1, N, d] (see
    the module docstring)."""
    d: Divided = call.divided
    x = hidden_states[0]  # (N, d)
    mixed, z, b_logit, a_logit = _project(module, x)  # (N, C), (N, Hv, Dv), (N, Hv), (N, Hv)
    weight = module.conv1d.weight[:, 0, :]  # (C, K)
    width = weight.shape[1] - 1
    table = block_tails(mixed, d, width)
    segments = d.segments()
    transitions, links, ends, parts = [], [], {}, []
    for s, e in segments:
        r0 = d.local_row(s)
        r1 = r0 + (e - s)
        conv, tail = causal_conv1d_with_tail(mixed[r0:r1].transpose(0, 1), weight, module.conv1d.bias,
                                             tail_before(s, mixed, table, d, width), activation=module.activation)
        q, k, v = _split_heads(module, conv.transpose(0, 1))
        read, out0, a, c = gated_delta_transition(q, k, v, _log_decay(module, a_logit[r0:r1]),
                                                  b_logit[r0:r1].sigmoid())
        parts.append((read, out0))
        transitions.append((a, c))
        src = -1 if s == 0 else d.owner(s - 1)
        dst = d.owner(e) if e < d.total and d.owner(e) != d.rank else None
        links.append((src, dst))
        ends[e] = tail
    hv, dk = module.num_v_heads, module.head_k_dim
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    chained = chain_states(transitions, links, d.cp, (hv, dk, module.head_v_dim), acc, x.device)
    out = [finish_outputs(read, out0, start) for (read, out0), (start, _) in zip(parts, chained)]
    del parts, transitions  # each token's start-state read and zero-start output: not held through the gated norm
    out = torch.cat(out).to(x.dtype) if out else x.new_zeros(0, hv, module.head_v_dim)

    end_state = {e: end for (_, e), (_, end) in zip(segments, chained)}
    share_snapshots(call.states[-1].layers[module.layer_idx], d, end_state, ends, (hv, dk, module.head_v_dim), acc,
                    mixed.new_zeros(mixed.shape[1], width))
    return _gated_output(module, out.reshape(x.shape[0], hv, -1), z, (1, x.shape[0]))


def share_snapshots(layer: RecurrentState, d: Divided, end_state: dict, ends: dict, shape, acc, tail_like) -> None:
    """Put into `layer` the snapshots every rank keeps (`d.snapshots`), from the owners of
    the segments that end there (`end_state`: position -> recurrent state, `ends`:
    position -> conv tail, this rank's only), summed over ranks; `shape` / `acc`: a
    recurrent state's, `tail_like` a conv tail's zeros."""
    states = torch.zeros(len(d.snapshots), *shape, dtype=acc, device=tail_like.device)
    tails = tail_like.new_zeros(len(d.snapshots), *tail_like.shape)
    for i, p in enumerate(d.snapshots):
        if p in end_state:
            states[i], tails[i] = end_state[p], ends[p]
    if d.world > 1:
        all_reduce_sum(states, d.cp)
        all_reduce_sum(tails, d.cp)
    for i, p in enumerate(d.snapshots):
        layer.put(p, states[i], tails[i])
    if layer.host and d.snapshots:  # the latest, still on the device, is a view: of every snapshot's block
        last = d.snapshots[-1]
        layer.snapshots[last] = tuple(t.clone() for t in layer.snapshots[last])


def routed_gdn(modules):
    """Within the block, each GDN module in `modules` runs `gdn_forward`."""
    return forwards_replaced(modules, [gdn_forward.__get__(m) for m in modules])
