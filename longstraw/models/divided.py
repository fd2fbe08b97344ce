"""Phase "divided": a context-parallel capture in which each prompt token is computed on
one rank (the rank that owns its block), layer by layer.

`sequence_parallel.py` runs the model's own decoder stack once over this rank's positions
(blocks of B, block b on rank b % W, the same deal as the sharded state), so every
projection, norm and MLP/MoE block of capture runs on 1/W of the tokens. Two kinds of
layer need positions held elsewhere:

    attention  `divided_attention`: the layer's own K/V rows go into the sharded state,
               then the queries attend over every rank's rows (fetched piece by piece,
               `ops/divided_attention.py`); the global causal order is exact.
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.causal_conv import causal_conv1d_with_tail
from ..ops.divided_attention import (divided_causal_attention, divided_indexer_topk, divided_sparse_attention,
                                     own_positions)
from ..ops.gated_delta_scan import chain_states, finish_outputs, gated_delta_transition
from ..state import RecurrentState
from .base import forwards_replaced


@dataclass(frozen=True)
class Divided:
    """What a divided capture's layers need to know.

    Fields:
        total: positions captured (0 .. total - 1), all ranks together.
        rank, world, block: the round-robin deal (block b on rank b % world).
        cp: the `distributed.ContextParallel` (None: one process).
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


# ----------------------------------------------------------------------------
# Gated DeltaNet layers


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
        from ..ops.collectives import all_gather

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
        from ..ops.collectives import all_reduce_sum

        all_reduce_sum(states, d.cp)
        all_reduce_sum(tails, d.cp)
    layer: RecurrentState = call.states[-1].layers[module.layer_idx]
    for i, p in enumerate(d.snapshots):
        layer.put(p, states[i], tails[i])
    return gated_output(module, out.reshape(x.shape[0], hv, -1), z, (1, x.shape[0]))
