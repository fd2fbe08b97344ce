"""Attention of new queries over a captured prefix plus their own causal block.

This is the one attention op of the engine, used both by capture (a prompt chunk
over the state of earlier chunks) and by replay (a response branch over the whole
prompt state). The two parts are computed separately and merged by log-sum-exp,
flash-style:

    o = (e^{lse_p} o_p + e^{lse_s} o_s) / (e^{lse_p} + e^{lse_s})

* The prefix part (`PrefixAttention`) walks the prefix in blocks of `block_size`
  positions with an online softmax. Its custom backward recomputes each block, so
  per layer it holds O(queries x block) memory, never O(queries x S). The prefix K/V
  are read in place: never copied, concatenated or saved at full size.
* The self part (causal over the T new tokens) runs through the same blockwise
  kernel with a causal mask; its backward returns dk, dv of the new tokens, so a long
  branch never holds a T x T score matrix for backward.

Legend: Hkv kv heads, g = H / Hkv queries per kv head, T new tokens, M = g*T query
rows per kv head, S prefix positions, D head dim, Dv value dim. GQA is done by
folding the g query heads of a kv head into rows, never by expanding K/V.
Arithmetic is float32 for half/float32 inputs and float64 for float64 inputs.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..tensors import KVSegment, accumulation_dtype
from . import flash
from longstraw.parallel.collectives import GatherRows, MergeAcrossRanks, SumGradAcrossRanks
from .prefix_blocks import prefix_attention_backward, prefix_attention_forward
from .rows import from_rows, to_rows
from .flash import (FlashAttention, KeptAttention, can_use_flash_autograd, empty_partial, fused_kernel, fused_takes, merge_partials,
                    merge_sink)


class PrefixAttention(torch.autograd.Function):
    """(o_p, lse_p) of query rows over a prefix of keys, blockwise, with recompute.

    forward(q [Hkv, M, D], k [Hkv, S, D], v [Hkv, S, Dv], q_pos [M], k_start, scale,
    window, block_size, sink) -> (o [Hkv, M, Dv], lse [Hkv, M]), both in the
    accumulation dtype. k_start: the first key's position (an int), or every key's
    position (LongTensor [S]: a shard's rows, which are not consecutive). Rows that see
    no prefix key get o = 0, lse = -inf.

    Gradients flow to q always; to k / v when they require grad; and, when `sink` is
    a pair of buffers (dk [Hkv, S, D], dv [Hkv, S, Dv]), dLoss/dk and dLoss/dv are
    added into them in place, block by block (exact mode: the state owns its
    gradient, summed over branches, never a second full-size temporary).
    """

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_start, scale, window, block_size, sink=None, causal=False):
        k_positions, k_first = _split_start(k_start)
        out, lse = prefix_attention_forward(q, k, v, q_pos, k_positions, k_first, scale, window, block_size, causal)
        if k.requires_grad or v.requires_grad:  # a chunk's or piece's own keys, made in the graph: saved, so
            # that a checkpointed layer (layer recompute) holds none of them until its backward recomputes it
            ctx.save_for_backward(q, out, lse, q_pos, k, v)
            ctx.prefix = None
        else:  # the captured state: held by reference (its staged rows may be rewritten in place later)
            ctx.save_for_backward(q, out, lse, q_pos)
            ctx.prefix = (k, v)
        ctx.sink = sink
        ctx.k_start, ctx.scale, ctx.window, ctx.block_size, ctx.causal = k_start, scale, window, block_size, causal
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        saved = ctx.saved_tensors
        q, out, lse, q_pos = saved[:4]
        k, v = ctx.prefix if ctx.prefix is not None else saved[4:]
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        need_dk, need_dv = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        sink_k, sink_v = ctx.sink if ctx.sink is not None else (None, None)
        k_positions, k_first = _split_start(ctx.k_start)
        dq, dk, dv = prefix_attention_backward(q, k, v, out, lse, q_pos, k_positions, k_first, grad_out, grad_lse,
                                               sink_k, sink_v, need_dk, need_dv, ctx.scale, ctx.window,
                                               ctx.block_size, ctx.causal)
        return dq, dk if need_dk else None, dv if need_dv else None, None, None, None, None, None, None, None


def _split_start(k_start) -> tuple[torch.Tensor | None, int]:
    """`PrefixAttention`'s k_start as the ops take it, (k_positions, k_first): (every key's
    positions, 0) for a LongTensor [S], (None, the first key's position) for an int."""
    return (k_start, 0) if isinstance(k_start, torch.Tensor) else (None, int(k_start))


class KeptPrefixAttention(torch.autograd.Function):
    """The blockwise kernel's twin of `flash.KeptAttention`: exact mode's walk with kept
    attention outputs (`state/kept_outputs.py`) where the walk's attention is blockwise
    (CUDA, sliding windows, torch without the fused CPU backward).

    forward(rows [Hkv, M, D], k, v [Hkv, T, D] of the chunk, prefixes (unsharded
    `KVSegment`s), q_pos [M], q_start, scale, window, block_size, kept = (o [H, T, Dv],
    lse [H, T]) from capture) -> o [Hkv, M, Dv] in the accumulation dtype, without
    attending. Backward: each part (the causal self part, every prefix segment) is
    `PrefixAttention.backward` run with the GLOBAL o and lse (exp(s - lse) is already the
    whole softmax's probability, so dS = P (dO v^T - rowsum(dO o)) per part, as in the
    flash identity): dq summed over the parts, dk / dv of the chunk's own keys, and the
    prefix's into the segments' sinks. Its naive twin: the blockwise walk that attends."""

    @staticmethod
    def forward(ctx, rows, k, v, prefixes, q_pos, q_start, scale, window, block_size, kept):
        hkv, m, _ = rows.shape
        acc = accumulation_dtype(rows.dtype)
        out, lse = kept[0].reshape(hkv, m, -1).to(acc), kept[1].reshape(hkv, m).to(acc)
        ctx.save_for_backward(rows, k, v, out, lse, q_pos)
        ctx.prefixes, ctx.q_start, ctx.scale, ctx.window, ctx.block_size = prefixes, q_start, scale, window, block_size
        return out.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        rows, k, v, out, lse, q_pos = ctx.saved_tensors

        def part(seg_k, seg_v, k_start, sink, causal):  # PrefixAttention's backward of one part
            part_ctx = SimpleNamespace(saved_tensors=(rows, out, lse, q_pos), prefix=(seg_k, seg_v), sink=sink,
                                       k_start=k_start, scale=ctx.scale, window=ctx.window,
                                       block_size=ctx.block_size, causal=causal,
                                       needs_input_grad=(True, causal, causal))
            return PrefixAttention.backward(part_ctx, grad_out, None)[:3]

        dq, dk, dv = part(k, v, ctx.q_start, None, True)
        dq = dq.to(out.dtype)
        for seg in ctx.prefixes:
            dq += part(seg.k, seg.v, seg.key_start, seg.grad, False)[0].to(out.dtype)
        return dq.to(rows.dtype), dk, dv, None, None, None, None, None, None, None


def _kept_blockwise(rows, k, v, prefixes, q_pos, q_start: int, scale: float, window, block_size: int, kept,
                    out_shape) -> torch.Tensor | None:
    """The walk's attention from kept outputs through the blockwise kernel
    (`KeptPrefixAttention`) -> [H, T, Dv] in the queries' dtype; None where it does not
    apply (no autograd, or a context-parallel shard among the prefixes)."""
    if not torch.is_grad_enabled() or any(seg.cp is not None for seg in prefixes):
        return None
    used = [seg for seg in prefixes if seg.k.shape[1] > 0]
    out = KeptPrefixAttention.apply(rows, k, v, used, q_pos, q_start, scale, window, block_size, kept)
    return out.reshape(out_shape).to(rows.dtype)




def can_use_fused(q, k, v, prefixes: list[KVSegment], window) -> bool:
    """The fused path needs: no autograd, no gradient sinks, no window, CPU, value dim =
    key dim (the kernel's constraint; absorbed MLA has Dv < D), a dtype the kernel takes."""
    if not fused_takes(q, v.shape[-1], window):
        return False
    if torch.is_grad_enabled() and any(seg.grad is not None for seg in prefixes):
        return False  # (without autograd nothing is ever added into the sinks)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, *(seg.k for seg in prefixes))):
        return False
    return True


def _flash_partial(q, k, v, scale: float, causal: bool):
    """Forward-only partial attention with torch's fused flash kernel, which tiles
    internally (O(rows) memory for any S) and returns the log-sum-exp.
    q [H, T, D]; k, v [Hkv, S, D] -> (o [Hkv, g*T, Dv], lse [Hkv, g*T]) in row layout."""
    flash = fused_kernel(q.device.type, q.dtype)
    h, t, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    if causal:  # the new tokens' own keys: expand them over the GQA group (T-sized, never the state)
        out, lse = flash(q[None], k.repeat_interleave(g, 0)[None], v.repeat_interleave(g, 0)[None], True,
                         scale)  # (1, H, T, Dv), (1, H, T)
    else:  # no mask, so the g query heads of a kv head fold into rows
        out, lse = flash(q.reshape(1, hkv, g * t, d), k[None], v[None], False, scale)
    return out[0].reshape(hkv, g * t, -1).to(lse.dtype), lse[0].reshape(hkv, g * t)


def _own_self_part(rows, k, v, q_start: int, own_rows, attend):
    """The divided walk's self part (blockwise path; `flash._own_self_part` is the fused
    one): rows [Hkv, g*T, D] -> (o [Hkv, g*T, Dv], lse [Hkv, g*T]), this rank's query rows
    attended causally (by position) over the T keys, every rank's gathered (`GatherRows`,
    whose backward keeps this rank's rows of the replicated gradient). The keys and values
    pass `SumGradAcrossRanks`, so their gradient, partial per rank, is summed."""
    index, cp = own_rows
    hkv, m, d = rows.shape
    t = k.shape[1]
    g = m // t
    mine = index[cp.rank]
    sel = (torch.arange(g, device=rows.device)[:, None] * t + mine[None, :]).reshape(-1)  # (g*n,)
    k_sum, v_sum = SumGradAcrossRanks.apply(k, cp), SumGradAcrossRanks.apply(v, cp)
    o, lse = attend(rows[:, sel], k_sum, v_sum, q_start, None, True, q_pos=(mine + q_start).repeat(g))
    width = o.shape[-1] + 1
    both = torch.cat([o, lse[..., None].to(o.dtype)], -1).reshape(hkv, g, mine.numel(), width)
    full = GatherRows.apply(both, index, cp).reshape(hkv, m, width)  # (Hkv, g*T, Dv + 1)
    return full[..., :-1], full[..., -1]


def _check_shapes(q, k, prefixes: list[KVSegment], q_start: int, walk: bool) -> None:
    """`prefix_causal_attention`'s inputs agree: q [B, H, T, D] with H a multiple of k's
    [B, Hkv, T, D] heads, every prefix segment [Hkv, S, D] ends before the queries, and a
    batch (B > 1) is no walk's."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    assert h % hkv == 0, f"query heads {h} not a multiple of kv heads {hkv}"
    assert q.shape[0] == 1 or not walk, "a batch of branches is replay's: no walk"
    for seg in prefixes:
        assert seg.k.shape[0] == hkv and seg.k.shape[2] == d, (seg.k.shape, k.shape)
        assert seg.start + seg.k.shape[1] <= q_start, "a prefix segment must end before the queries"


def _batched_self_part(attend, q, k, v, q_start: int):
    """The causal self part of B branches, each over its own keys: q [B, H, T, D], k, v
    [B, Hkv, T, .] -> (o [Hkv, B*g*T, Dv], lse [Hkv, B*g*T]) in the row layout of the
    shared prefix (`rows.py`); `attend` is `prefix_causal_attention`'s kernel call."""
    bsz, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    k_pos = torch.arange(q_start, q_start + t, device=q.device)
    out, lse = attend(q.reshape(bsz * hkv, g * t, d), k.reshape(bsz * hkv, t, d), v.reshape(bsz * hkv, t, -1),
                      q_start, None, True, q_pos=k_pos.repeat(g))  # (B*Hkv, g*T, Dv), (B*Hkv, g*T)
    out = out.reshape(bsz, hkv, g * t, -1).movedim(0, 1).reshape(hkv, bsz * g * t, -1)
    return out, lse.reshape(bsz, hkv, g * t).movedim(0, 1).reshape(hkv, bsz * g * t)


def _fused_autograd(q, k, v, prefixes, q_start: int, scale: float, own_rows, kept):
    """The fused kernel with autograd: `FlashAttention` -> [Hkv, g*T, Dv], or, with the walk's
    kept (o, lse), `KeptAttention` (no forward, the same backward)."""
    # a shard joins whenever any rank may hold rows before the queries (even if this one holds none)
    used = [s for s in prefixes if (s.k.shape[1] > 0 if s.cp is None else q_start > s.start)]
    if kept is not None and own_rows is None:  # the walk: capture's output, no attention again
        return KeptAttention.apply(q, k, v, used, scale, flash.BACKWARD_BLOCK, kept)
    return FlashAttention.apply(q, k, v, used, scale, flash.BACKWARD_BLOCK, own_rows)


def prefix_causal_attention(q, k, v, *, prefixes: list[KVSegment], q_start: int, scale: float,
                            window: int | None = None, block_size: int = 1024, allow_fused: bool = True,
                            own_rows=None, sinks: torch.Tensor | None = None, return_lse: bool = False,
                            kept: tuple | None = None):
    """Attention of T new tokens over earlier state segments plus themselves.

    Args:
        q: [H, T, D] queries at positions q_start ..; batched replay: [B, H, T, D], B branches
            over the same prefixes (`rows.py`). k, v: [(B,) Hkv, T, D / Dv] of the same tokens.
        prefixes: `KVSegment`s, all before q_start (the prompt state; in a branch
            replayed in pieces, also the earlier pieces). Empty segments are skipped.
            A segment with `cp` set holds only this rank's rows of a context-parallel
            shard: its partial attention is merged across ranks (`longstraw/parallel/collectives.py`).
        scale: softmax scale. window: sliding window W or None. block_size: positions per block.
        allow_fused: use torch's fused flash kernel where one fits (`fused_kernel`: CPU,
            or CUDA in half precision); False forces the blockwise torch path.
        own_rows: context parallelism's divided walk, (index, cp) with index[s] the rows
            (LongTensor, increasing) of the T queries that rank s owns: this rank runs the
            causal self part for its own rows only and the ranks' partials are gathered,
            so the output is still every row's, the same on every rank; the self part's
            k, v gradients are summed over ranks and its q gradient is this rank's rows'
            only. Every rank must call with the same q, k, v and upstream gradient.
        sinks: [H] sink logits (gpt-oss; no value), merged once into the whole LSE
            (`flash.merge_sink`), with their gradient; the blockwise kernel runs then.
        return_lse: also return the LSE [H, T] (before any sink; accumulation dtype).
        kept: the walk's (o [H, T, Dv], lse [H, T]) from capture: no forward (`KeptAttention`s).

    Returns:
        [H, T, Dv] attention output ([B, H, T, Dv]), in q's dtype (and the LSE with `return_lse`).
    """
    batched = q.dim() == 4  # a batch of branches over the same prefixes (batched replay)
    q4, k4, v4 = (q, k, v) if batched else (q[None], k[None], v[None])
    _check_shapes(q4, k4, prefixes, q_start, walk=own_rows is not None or kept is not None)
    (bsz, h, t, _), hkv = q4.shape, k4.shape[1]
    g = h // hkv
    unbatch = (lambda x: x) if batched else (lambda x: x[0])
    needs_lse = sinks is not None or return_lse  # the fused autograd kernel returns no LSE
    if not needs_lse and allow_fused and torch.is_grad_enabled() and can_use_flash_autograd(q, k, v, prefixes, window):
        out = _fused_autograd(q, k, v, prefixes, q_start, scale, own_rows, kept).to(q.dtype)  # (Hkv, B*g*T, Dv)
        return unbatch(from_rows(out, bsz, h))
    fused = allow_fused and own_rows is None and not batched and can_use_fused(q, k, v, prefixes, window)
    rows = to_rows(q4, hkv)  # (Hkv, M, D), M = B*g*T: head j*g+i of branch b -> kv head j (`rows.py`)
    k_pos = torch.arange(q_start, q_start + t, device=q.device)
    q_pos = k_pos.repeat(bsz * g)  # (M,)
    if kept is not None and sinks is None and own_rows is None and not fused and (out := _kept_blockwise(
            rows, k, v, prefixes, q_pos, q_start, scale, window, block_size, kept, (h, t, -1))) is not None:
        return out

    def attend(rows_in, seg_k, seg_v, seg_start, grad, causal, q_pos=q_pos):
        if fused and seg_k.shape[1] == 0:  # an empty shard on this rank: contributes nothing
            return empty_partial(q, hkv, g * t, seg_v.shape[-1])
        if fused:
            return _flash_partial(q, seg_k, seg_v, scale, causal)
        if grad is not None and torch.is_grad_enabled() and not rows_in.requires_grad:
            # a gradient sink must see backward even when nothing upstream needs dq (a frozen
            # first layer under LoRA): make the queries a throwaway leaf
            rows_in = rows_in.detach().requires_grad_()
        return PrefixAttention.apply(rows_in, seg_k, seg_v, q_pos, seg_start, scale, window, block_size, grad, causal)

    # self part, causal: the blockwise kernel holds O(M x block) and returns dk, dv (no M x T scores)
    if own_rows is None:
        out, lse = _batched_self_part(attend, q4, k4, v4, q_start)
    else:
        out, lse = _own_self_part(rows, k, v, q_start, own_rows, attend)
    for seg in prefixes:
        if seg.cp is not None:  # this rank's shard: merge the partial across ranks
            if q_start <= seg.start:
                continue  # no rank holds anything before the queries
            rows_in = rows if fused else SumGradAcrossRanks.apply(rows, seg.cp)
            partial = attend(rows_in, seg.k, seg.v, seg.key_start, seg.grad, False)  # (o, lse) of this rank's rows
            out_p, lse_p = MergeAcrossRanks.apply(*partial, seg.cp)
        elif seg.k.shape[1] == 0:
            continue
        else:
            out_p, lse_p = attend(rows, seg.k, seg.v, seg.key_start, seg.grad, False)
        out, lse = merge_partials(out_p, lse_p, out, lse), torch.logaddexp(lse_p, lse)
    out, lse = unbatch(from_rows(out, bsz, h)), unbatch(from_rows(lse, bsz, h))  # rows are heads ([B,] H, T)
    if sinks is not None:  # once, over every key
        out = merge_sink(out, lse, sinks[:, None])
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)
