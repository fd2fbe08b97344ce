"""Phase "divided": a context-parallel capture in which each prompt token is computed on
one rank (the rank that owns its block), layer by layer.

`parallel.divided.py` runs the model's own decoder stack once over this rank's positions
(blocks of B, block b on rank b % W, the same deal as the sharded state), so every
projection, norm and MLP/MoE block of capture runs on 1/W of the tokens. Two kinds of
layer need positions held elsewhere:

    attention  `divided_attention`: the layer's own K/V rows go into the sharded state,
               then the queries attend over every rank's rows (fetched piece by piece,
               `longstraw/parallel/attention.py`); the global causal order is exact.
    MLA        `divided_mla`: the layer's own latent rows (and indexer keys) go into the
               sharded state; its absorbed queries attend over every rank's latent rows
               (fetched piece by piece), or, with DSA, over the rows of the global top-k
               (selected over every rank's indexer keys, fetched piece by piece).
    GDN        `divided_gdn`: each own segment (a block, cut at the snapshot positions)
               gets its conv tail from the previous block's owner (one all-gather of
               every block's last K-1 pre-conv rows), then its affine transition
               (`ops/gated_delta_scan.py`); a relay across ranks carries the recurrent
               state from segment to segment; each rank finishes its outputs, and the
               snapshots every rank needs (the end; exact mode: every chunk start) are
               summed over ranks from their owners.

The MLP/MoE blocks run in pieces of `chunk_size` tokens (`chunked_mlps`), so a layer's
working set is the attention projections of the shard plus one MLP piece.

Exact mode's divided reverse walk reuses the deal with autograd, one walk chunk at a
time (`DividedChunk`): `divided_recompute_attention` gathers the chunk's q/k/v rows,
attends as the replicated walk does (the chunk's own causal part for this rank's query
rows only), and keeps this rank's rows; `divided_recompute_gdn`
projects this rank's rows, gathers the chunk's projected rows, runs the conv and the
recurrence over the whole chunk on every rank, and keeps this rank's rows; an MLA
layer gathers the chunk's absorbed queries and latent rows (`gather_mla_chunk`, and the
indexer's inputs, no grad), attends as the replicated walk does (`mla.mla_forward`), and
keeps this rank's rows (`own_chunk_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ops.causal_conv import causal_conv1d_with_tail
from longstraw.parallel.attention import (divided_causal_attention, divided_indexer_topk, divided_sparse_attention,
                                     own_positions)
from ..ops.gated_delta_scan import chain_states, finish_outputs, gated_delta_transition
from longstraw.state.prompt import RecurrentState
from .base import forwards_replaced


@dataclass(frozen=True)
class Divided:
    """What a divided capture's layers need to know.

    Fields:
        total: positions captured (0 .. total - 1), all ranks together.
        rank, world, block: the round-robin deal (block b on rank b % world).
        cp: the `parallel.context.ContextParallel` (None: one process).
        snapshots: sorted positions where GDN layers keep a snapshot on every rank (the
            end; exact mode: also every chunk boundary).
        chunk_size: tokens per MLP piece, and rows per fetched K/V piece.
    """

    total: int
    rank: int
    world: int
    block: int
    cp: object
    snapshots: tuple[int, ...]
    chunk_size: int

    def owner(self, position: int) -> int:
        return (position // self.block) % self.world

    def blocks(self) -> list[tuple[int, int, int]]:
        """This rank's blocks: (first position, end position, first local row)."""
        out = []
        for i, b in enumerate(range(self.rank, -(-self.total // self.block), self.world)):
            out.append((b * self.block, min(self.total, (b + 1) * self.block), i * self.block))
        return out

    def positions(self, device=None) -> torch.Tensor:
        """This rank's positions [N], increasing."""
        return own_positions(self.total, self.rank, self.world, self.block, device)

    def local_row(self, position: int) -> int:
        """Row of an own position in this rank's [N, ..] tensors."""
        return (position // self.block // self.world) * self.block + position % self.block

    def segments(self) -> list[tuple[int, int]]:
        """This rank's GDN segments: its blocks cut at the snapshot positions, (first, end)."""
        out = []
        for a, b, _ in self.blocks():
            cuts = [a] + [p for p in self.snapshots if a < p < b] + [b]
            out += list(zip(cuts, cuts[1:]))
        return out


def rows_per_rank(start: int, end: int, world: int, block: int) -> list[int]:
    """How many positions of [start, end) each rank owns (block b on rank b % world),
    from the geometry alone: no tensor, no device."""
    counts = [0] * world
    first, last = start // block, (end - 1) // block
    if end <= start:
        return counts
    cycles, rest = divmod(last - first + 1, world)  # whole cycles of `world` blocks, then `rest` blocks
    for s in range(world):
        counts[s] = cycles * block
    for b in range(first + cycles * world, last + 1):
        counts[b % world] += block
    counts[first % world] -= start - first * block  # the first block starts inside
    counts[last % world] -= (last + 1) * block - end  # the last block ends inside
    return counts


def chunk_rows(start: int, end: int, world: int, block: int, device=None) -> list[torch.Tensor]:
    """Per rank, the indices [n_s] (within the chunk [start, end), increasing) of its
    positions. One stable argsort of the owners on `device`, split by the counts the
    geometry gives (`rows_per_rank`): no `nonzero`, so no host sync."""
    owner = torch.div(torch.arange(start, end, device=device), block, rounding_mode="floor") % world  # (T,)
    order = torch.argsort(owner, stable=True)  # (T,): rank 0's rows, then rank 1's, ...
    return list(order.split(rows_per_rank(start, end, world, block)))


@dataclass(frozen=True)
class DividedChunk:
    """One chunk [start, end) of a divided reverse walk (exact mode): this rank recomputes,
    with autograd, only the positions of the chunk it owns (block b on rank b % world).

    Fields:
        start, end: the chunk's absolute positions.
        rank, world, block: the round-robin deal of the sharded state.
        cp: the `parallel.context.ContextParallel`.
        chunk_size: the capture chunk (a hybrid's walk chunk is whole capture chunks).
    """

    start: int
    end: int
    rank: int
    world: int
    block: int
    cp: object
    chunk_size: int
    _rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # device -> rows()

    def rows(self, device=None) -> list[torch.Tensor]:
        """Per rank, the indices [n_s] (within the chunk, increasing) of its positions:
        computed once per device (`chunk_rows`), then the same tensors on every call (every
        layer of the chunk's recomputation asks, forward and backward)."""
        key = torch.device("cpu") if device is None else torch.device(device)
        if key not in self._rows:
            self._rows[key] = chunk_rows(self.start, self.end, self.world, self.block, key)
        return self._rows[key]

    def positions(self, device=None) -> torch.Tensor:
        """This rank's positions of the chunk [n], increasing."""
        return self.rows(device)[self.rank] + self.start


def chunked_mlps(layers, size: int):
    """Within the block, each decoder layer's `mlp` runs over pieces of `size` tokens; a
    last piece of one token joins the one before it. (DeepSeek's and GLM-5's MoE routers
    compute their logits in float32, and one token takes BLAS's matrix-vector path,
    which rounds differently from the matrix products of a chunked capture.)"""
    mlps = [layer.mlp for layer in layers if hasattr(layer, "mlp")]

    def chunked(forward):
        def run(x):  # x [1, N, d]
            n = x.shape[1]
            if n <= size + 1:
                return forward(x)
            starts = list(range(0, n, size))
            if n - starts[-1] == 1:
                starts.pop()
            outs = [forward(x[:, a:b]) for a, b in zip(starts, starts[1:] + [n])]
            return torch.cat([o[0] if isinstance(o, tuple) else o for o in outs], dim=1)
        return run
    return forwards_replaced(mlps, [chunked(m.forward) for m in mlps])


# ----------------------------------------------------------------------------
# attention layers


def divided_attention(module, query, key, value, call, scaling):
    """query [1, H, N, D], key/value [1, Hkv, N, D] of this rank's positions -> ([1, N, H, Dv], None)."""
    d: Divided = call.divided
    kv = call.states[-1].layers[module.layer_idx]
    kv.append_own(key[0], value[0], d.total)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = divided_causal_attention(query[0], key[0], value[0], positions=d.total, rank=d.rank, world=d.world,
                                   block=d.block, scale=scale, cp=d.cp, piece_rows=d.chunk_size)  # (H, N, Dv)
    return out.transpose(0, 1)[None], None


def divided_recompute_attention(module, query, key, value, call, scaling):
    """A divided reverse walk's attention (exact mode): query [1, H, n, D], key/value
    [1, Hkv, n, D] of this rank's n positions of the chunk -> ([1, n, H, Dv], None).

    The chunk's q/k/v rows of every rank are gathered (`GatherRows`), and the attention
    of the whole chunk runs as in the replicated walk, except that its own causal part
    runs for this rank's query rows only, the ranks' partials gathered (`own_rows`), and
    the part over earlier chunks is divided by the sharded state (partials merged across
    ranks). Only this rank's output rows go on; their gradient is summed over ranks
    (`SumGradAcrossRanks`) so that the attention's backward sees the whole chunk's
    upstream gradient, identical on every rank, and each rank keeps the q/k/v gradient
    of its own rows. This rank's own K/V rows are the chunk's roots, seeded with the
    gradients its shard accumulated for them (no all-reduce of seeds)."""
    from ..ops.attention import prefix_causal_attention
    from longstraw.parallel.collectives import GatherRows

    d: DividedChunk = call.divided
    kv = call.states[-1].layers[module.layer_idx]
    assert len(call.states) == 1 and kv.shard is not None and kv.window is None, "divided walk: a sharded prompt"
    q, k, v = query[0], key[0], value[0]  # (H, n, D), (Hkv, n, D), (Hkv, n, Dv)
    h, hkv = q.shape[0], k.shape[0]
    index = d.rows(q.device)
    if k.shape[-1] == v.shape[-1]:  # one all-gather for the three
        full_q, full_k, full_v = GatherRows.apply(torch.cat([q, k, v]), index, d.cp).split([h, hkv, hkv])
    else:
        full_q, full_k, full_v = (GatherRows.apply(x, index, d.cp) for x in (q, k, v))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = prefix_causal_attention(full_q, full_k, full_v, prefixes=[kv.segment(until=d.start)], q_start=d.start,
                                  scale=scale, block_size=call.block_size,
                                  own_rows=(index, d.cp))  # (H, T, Dv), the same on every rank
    out = own_chunk_rows(out, call)  # (H, n, Dv)
    if d.end <= kv.end:  # held: its gradient seeds the chunk
        call.states[-1].seeds.append(((k, v), lambda: kv.own_grads(d.start, d.end)))
    return out.transpose(0, 1)[None], None


# ----------------------------------------------------------------------------
# MLA (+ DSA) layers


def divided_mla(module, q_full, k_new, rank: int, topk, call, prev_indices, index_inputs):
    """Absorbed MLA of this rank's positions: q_full [H, N, R + Dr], k_new [N, R + Dr] (latent
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
        indices = prev_indices
        assert indices is not None, "a shared DSA layer needs the previous layer's selection"
    return divided_sparse_attention(q_full, k_new, indices, value_dim=rank, scale=module.scaling, **deal), indices


def gather_mla_chunk(q_full, k_new, index_inputs, call):
    """A divided reverse walk's MLA layer (exact mode): this rank's n rows of the chunk ->
    the whole chunk's T rows, in chunk order. q_full [H, n, R + Dr], k_new [n, R + Dr]
    (gathered with autograd, `GatherRows`: one all-gather for the two) and the indexer's
    inputs (queries [n, Hi, Di], keys [n, Di], weights [n, Hi], or None; gathered without
    grad, as the indexer runs) -> (q_full [H, T, R + Dr], k_new [T, R + Dr], index_inputs
    of T rows).

    The chunk's attention then runs as in the replicated walk (`mla.mla_forward`): the
    DSA selection and sparse attention's own causal part on every rank (a dense layer's
    causal part divided by query rows, `own_rows`), the part over earlier chunks divided
    by the sharded state. `own_chunk_rows` keeps this rank's rows of its output;
    the projections around it, the MoE and o_proj run on this rank's rows only."""
    from longstraw.parallel.collectives import GatherRows

    d: DividedChunk = call.divided
    index = d.rows(q_full.device)
    h = q_full.shape[0]
    both = GatherRows.apply(torch.cat([q_full, k_new[None]]), index, d.cp)  # (H + 1, T, R + Dr)
    if index_inputs is not None:
        queries, keys, weights = index_inputs
        n, hi, di = queries.shape
        with torch.no_grad():
            qk = GatherRows.apply(torch.cat([queries.reshape(n, hi * di), keys], 1), index, d.cp)  # (T, Hi Di + Di)
            index_inputs = (qk[:, : hi * di].reshape(-1, hi, di), qk[:, hi * di:],
                            GatherRows.apply(weights, index, d.cp))
    return both[:h], both[h], index_inputs


def own_chunk_rows(out: torch.Tensor, call) -> torch.Tensor:
    """A divided reverse walk: out [.., T, F], the same on every rank (the whole chunk's
    attention) -> this rank's rows [.., n, F]. Their gradient is summed over ranks
    (`SumGradAcrossRanks`), so the attention's backward sees the whole chunk's upstream
    gradient, identical on every rank."""
    from longstraw.parallel.collectives import SumGradAcrossRanks

    d: DividedChunk = call.divided
    return SumGradAcrossRanks.apply(out, d.cp)[..., d.rows(out.device)[d.rank], :]


# ----------------------------------------------------------------------------
# Gated DeltaNet layers


def divided_recompute_gdn(module, x, call, helpers, initial_snapshot):
    """A divided reverse walk's GDN layer (exact mode): x [n, d] of this rank's n positions
    of the chunk -> [1, n, d]. `helpers` are gated_deltanet's (project, split_heads,
    log_decay, gated_output); `initial_snapshot` its reader of the start snapshot.

    The per-token parts are divided: the input projections and the gated norm + output
    projection run on this rank's rows. The conv and the recurrence run over the whole
    chunk on every rank (they need every earlier position's state, and cost little next
    to the projections): the chunk's projected rows of every rank are gathered
    (`GatherRows`), the rule starts from the snapshot at the chunk's start as in the
    replicated walk, and this rank keeps its output rows, whose gradient is summed over
    ranks (`SumGradAcrossRanks`). That replicated part's backward is then identical on
    every rank, seeds at the chunk's end and snapshot gradients included (the GDN state
    is replicated); its parameters (conv, A_log, dt_bias) pass their gradient on the
    first rank only (`GradOnFirstRank`), so the walk's one sum over ranks counts it once.

    The decay is computed per capture chunk, as the replicated walk computes it: HF's
    decay casts A_log to float32, so each call rounds A_log's gradient to float32 once,
    and cutting where the replicated walk cuts keeps that rounding the same."""
    from longstraw.parallel.collectives import GatherRows, GradOnFirstRank, SumGradAcrossRanks
    from ..ops.gated_delta import chunk_gated_delta_rule

    project, split_heads, log_decay, gated_output = helpers
    d: DividedChunk = call.divided
    mixed, z, b_logit, a_logit = project(module, x)  # (n, C), (n, Hv, Dv), (n, Hv), (n, Hv)
    index = d.rows(x.device)
    widths = [mixed.shape[1], b_logit.shape[1], a_logit.shape[1]]
    full_mixed, full_b, full_a = GatherRows.apply(torch.cat([mixed, b_logit, a_logit], 1), index,
                                                  d.cp).split(widths, 1)  # (T, C), (T, Hv), (T, Hv)
    first = [None if p is None else GradOnFirstRank.apply(p, d.cp)
             for p in (module.conv1d.weight, module.conv1d.bias, module.A_log, module.dt_bias)]
    rec0, tail0 = initial_snapshot(call.states, module.layer_idx, d.start)
    conv, tail1 = causal_conv1d_with_tail(full_mixed.transpose(0, 1), first[0][:, 0, :], first[1], tail0,
                                          activation=module.activation)  # (C, T)
    q, k, v = split_heads(module, conv.transpose(0, 1))
    assert d.start % d.chunk_size == 0, "a hybrid's walk chunk starts at a capture chunk"
    decay = torch.cat([log_decay(module, full_a[i:i + d.chunk_size], (first[2], first[3]))
                       for i in range(0, full_a.shape[0], d.chunk_size)])  # (T, Hv)
    out, rec1 = chunk_gated_delta_rule(q, k, v, decay, full_b.sigmoid(), rec0,
                                       use_qk_l2norm=True)  # (T, Hv, Dv), the same on every rank
    out = SumGradAcrossRanks.apply(out, d.cp)[index[d.rank]]  # (n, Hv, Dv)
    layer: RecurrentState = call.states[-1].layers[module.layer_idx]
    if layer.grads is not None:  # seeded by what later readers of the snapshot added (on every rank alike)
        call.states[-1].seeds.append(((rec1, tail1), lambda: tuple(layer.grads.get(d.end, (None, None)))))
    return gated_output(module, out, z, (1, x.shape[0]))


def _block_tails(mixed: torch.Tensor, d: Divided, width: int) -> torch.Tensor:
    """Every block's last `width` pre-conv rows, all ranks: [blocks, width, C] (front zero
    padded for a block shorter than `width`), via one all-gather."""
    blocks = -(-d.total // d.block)
    per_rank = -(-blocks // d.world)  # the most blocks any rank owns (rank 0's)
    table = mixed.new_zeros(per_rank, width, mixed.shape[1])
    for i, (a, b, row) in enumerate(d.blocks()):
        m = min(width, b - a)
        table[i, width - m:] = mixed[row + (b - a) - m: row + (b - a)]
    if d.world == 1:
        gathered = [table]
    else:
        from longstraw.parallel.collectives import all_gather

        gathered = all_gather(table, d.cp)
    return torch.stack([gathered[b % d.world][b // d.world] for b in range(blocks)]) if blocks else table[:0]


def _tail_before(position: int, mixed, table, d: Divided, width: int) -> torch.Tensor:
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


def divided_gdn(module, x, call, helpers):
    """x [N, d] of this rank's positions -> [1, N, d]. `helpers` are gated_deltanet's
    (project, split_heads, log_decay, gated_output), so the family's layout stays there."""
    project, split_heads, log_decay, gated_output = helpers
    d: Divided = call.divided
    mixed, z, b_logit, a_logit = project(module, x)  # (N, C), (N, Hv, Dv), (N, Hv), (N, Hv)
    weight = module.conv1d.weight[:, 0, :]  # (C, K)
    width = weight.shape[1] - 1
    table = _block_tails(mixed, d, width)
    segments = d.segments()
    transitions, links, ends, parts = [], [], {}, []
    for s, e in segments:
        r0 = d.local_row(s)
        r1 = r0 + (e - s)
        conv, tail = causal_conv1d_with_tail(mixed[r0:r1].transpose(0, 1), weight, module.conv1d.bias,
                                             _tail_before(s, mixed, table, d, width), activation=module.activation)
        q, k, v = split_heads(module, conv.transpose(0, 1))
        read, out0, a, c = gated_delta_transition(q, k, v, log_decay(module, a_logit[r0:r1]),
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
    out = torch.cat(out).to(x.dtype) if out else x.new_zeros(0, hv, module.head_v_dim)

    # the snapshots every rank keeps, from the owners of the segments that end there
    states = torch.zeros(len(d.snapshots), hv, dk, module.head_v_dim, dtype=acc, device=x.device)
    tails = mixed.new_zeros(len(d.snapshots), mixed.shape[1], width)
    end_state = {e: end for (_, e), (_, end) in zip(segments, chained)}
    for i, p in enumerate(d.snapshots):
        if p in end_state:
            states[i], tails[i] = end_state[p], ends[p]
    if d.world > 1:
        from longstraw.parallel.collectives import all_reduce_sum

        all_reduce_sum(states, d.cp)
        all_reduce_sum(tails, d.cp)
    layer: RecurrentState = call.states[-1].layers[module.layer_idx]
    for i, p in enumerate(d.snapshots):
        layer.put(p, states[i], tails[i])
    return gated_output(module, out.reshape(x.shape[0], hv, -1), z, (1, x.shape[0]))
