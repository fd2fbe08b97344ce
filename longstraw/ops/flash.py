"""torch's fused flash-attention kernels, forward and backward, for the LSE-merged
attention of new tokens over a captured prefix plus themselves.

The blockwise kernel (`attention.PrefixAttention`) is the naive-twin-tested reference;
this module is its fast path wherever torch has a fused kernel with a backward that
takes the log-sum-exp (CPU: the flash-attention-for-CPU forward/backward aten ops, in
float32, float64 and bfloat16). Where the fused kernel runs at all is one pure
function of the device's facts, `select_kernel` (CUDA: sm80+, fp16/bf16, D % 8 == 0,
D <= 256, torch's flash switch on); everywhere else the blockwise kernel runs.

Forward: one fused call for the causal self part and one per prefix segment (the
kernel tiles internally: O(rows) memory for any S), merged by log-sum-exp.

Backward, exact across the merge (the ring-attention identity): with the merged output
o and log-sum-exp L, each part's probabilities are exp(s - L), so every part's gradient
is the ordinary flash backward of that part called with the GLOBAL o, L and dO:

    dS_part = exp(s - L) * (dO v^T - rowsum(dO * o))

No per-part LSE gradient is needed. Prefix segments are walked in blocks of
`backward_block` positions, so the per-call dk / dv temporaries are block-sized; they
are added into the segment's gradient sinks (exact mode) and never into the segment.

Legend: H query heads, Hkv kv heads, g = H / Hkv, T new tokens, M = g*T query rows per
kv head, S prefix positions, D head dim (the kernels need Dv = D).
"""

from __future__ import annotations

import torch

from ..defaults import FLASH_BACKWARD_BLOCK
from ..tensors import accumulation_dtype
from .flash_prefix import flash_prefix_backward
from .rows import from_rows, to_rows
from longstraw.parallel.collectives import all_reduce_sum, gather_rows, merge_across_ranks

FUSED_ENABLED = True
"""Allow the fused kernels (set False to force the blockwise path everywhere)."""

BACKWARD_BLOCK = FLASH_BACKWARD_BLOCK
"""Prefix positions per fused backward call (bounds its dk / dv temporaries; the planner
reads `defaults.FLASH_BACKWARD_BLOCK`)."""


def fused_kernel(device_type: str, dtype: torch.dtype):
    """torch's fused flash-attention op for this device and dtype, as a function
    (q, k, v, causal, scale) -> (out, lse) on [B, H, L, D] inputs, or None.

    CPU: `_scaled_dot_product_flash_attention_for_cpu` (float32/float64/bfloat16).
    CUDA: `_scaled_dot_product_flash_attention` (FlashAttention-2; half types only).
    Both return the natural-log log-sum-exp [B, H, L] in float32 (float64 on CPU for
    float64 inputs), which is what the LSE merge needs."""
    if not FUSED_ENABLED:
        return None
    if device_type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16):
        op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        return None if op is None else (lambda q, k, v, causal, scale: op(q, k, v, 0.0, causal, scale=scale)[:2])
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
        return None if op is None else (lambda q, k, v, causal, scale: op(q, k, v, 0.0, causal, False,
                                                                          scale=scale)[:2])
    return None


def fused_backward_kernel(device_type: str, dtype: torch.dtype):
    """The backward of `fused_kernel` as a function (dout, q, k, v, out, lse, causal,
    scale) -> (dq, dk, dv) on [B, H, L, D] inputs, or None. CPU only: CUDA's flash
    backward needs the forward's RNG and sequence bookkeeping, so CUDA keeps the
    blockwise kernel for autograd."""
    if not FUSED_ENABLED or device_type != "cpu" or dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return None
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return None if op is None else (lambda do, q, k, v, out, lse, causal, scale: op(do, q, k, v, out, lse, 0.0,
                                                                                   causal, scale=scale))


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial softmax attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b


def merge_sink(out, lse, sink):
    """Join a learned sink logit to the softmax denominator (gpt-oss's attention sinks):
    the sink is one more partial with no value (o = 0, lse = sink), so
    merge_partials(0, sink, out, lse) = out * sigmoid(lse - sink). out [..., Dv], lse
    [...] (the whole attention's, over every key), sink broadcast to lse's shape; done
    once per query, after every key block is merged. Returns out in lse's dtype."""
    return out * torch.sigmoid(lse - sink.to(lse.dtype))[..., None]


FLASH_MIN_CAPABILITY = (8, 0)
"""CUDA compute capability FlashAttention-2 (torch's fused CUDA kernel) needs (Ampere)."""

FLASH_MAX_HEAD_DIM = 256
"""Largest head dim FlashAttention-2 takes on CUDA."""


def select_kernel(device_type: str, capability: tuple[int, int] | None, head_dim: int, value_dim: int,
                  dtype: torch.dtype, *, fused_enabled: bool, flash_sdp_enabled: bool) -> str:
    """The attention kernel for these facts, a pure function: "flash" (torch's fused
    kernel) or "blockwise" (`attention.PrefixAttention`, which runs anywhere).

    Args:
        device_type: "cpu", "cuda", ...
        capability: the CUDA device's compute capability (major, minor); None off CUDA.
        head_dim / value_dim: D and Dv of the queries/keys and the values.
        dtype: the queries' dtype.
        fused_enabled: `FUSED_ENABLED`.
        flash_sdp_enabled: `torch.backends.cuda.flash_sdp_enabled()`, the user's switch
            for torch's flash kernels (honoured on CPU too, as torch's own SDPA does).

    CPU: float32/float64/bfloat16, any D. CUDA: capability >= sm80, fp16/bf16, D a
    multiple of 8 and <= 256. Both need Dv = D (absorbed MLA has Dv < D). Anything else,
    and any other device type: blockwise.
    """
    if not (fused_enabled and flash_sdp_enabled) or value_dim != head_dim:
        return "blockwise"
    if device_type == "cpu":
        return "flash" if dtype in (torch.float32, torch.float64, torch.bfloat16) else "blockwise"
    if device_type == "cuda":
        ok = (capability is not None and tuple(capability) >= FLASH_MIN_CAPABILITY
              and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM)
        return "flash" if ok else "blockwise"
    return "blockwise"


def kernel_for(device: torch.device, head_dim: int, value_dim: int, dtype: torch.dtype,
               window: int | None = None) -> str:
    """`select_kernel` with the facts read from torch for `device` (its CUDA capability,
    the flash switch), "blockwise" for a sliding window or when torch lacks the op."""
    if window is not None or fused_kernel(device.type, dtype) is None:
        return "blockwise"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return select_kernel(device.type, capability, head_dim, value_dim, dtype, fused_enabled=FUSED_ENABLED,
                         flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled())


def fused_takes(q: torch.Tensor, value_dim: int, window: int | None) -> bool:
    """torch's fused forward kernel takes queries like `q` ([.., D]) with this value dim
    on q's device (`kernel_for`): no sliding window, Dv = D, and a device, dtype and D
    it supports; otherwise the caller runs the blockwise kernel."""
    return kernel_for(q.device, q.shape[-1], value_dim, q.dtype, window) == "flash"


def empty_partial(like: torch.Tensor, heads: int, rows: int, value_dim: int):
    """(o = 0 [heads, rows, Dv], lse = -inf [heads, rows]) in `like`'s accumulation dtype:
    the partial attention over no keys (e.g. an empty shard on this rank)."""
    acc = accumulation_dtype(like.dtype)
    return (like.new_zeros(heads, rows, value_dim, dtype=acc), like.new_full((heads, rows), float("-inf"), dtype=acc))


def can_use_flash_autograd(q, k, v, prefixes, window) -> bool:
    """FlashAttention applies: a fused forward (`fused_takes`) and a fused backward for this
    device and dtype, and no prefix that itself requires grad (the prefix is captured
    state: constant to autograd, its gradient goes to sinks). Context-parallel shards are
    taken (merged across ranks in forward, their dq summed over ranks in backward)."""
    if not fused_takes(q, v.shape[-1], window) or fused_backward_kernel(q.device.type, q.dtype) is None:
        return False
    return not any(seg.k.requires_grad or seg.v.requires_grad for seg in prefixes)


def own_runs(mine: torch.Tensor) -> list[tuple[int, int]]:
    """The consecutive runs [(a, b)] of increasing chunk rows `mine` (a rank's blocks)."""
    runs: list[list[int]] = []
    for r in mine.tolist():
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return [(a, b) for a, b in runs]


def _own_self_part(flash, q, kx, vx, scale: float, own, acc):
    """Context parallelism's divided walk: the causal self part of this rank's query rows
    only, gathered from every rank. q [H, T, D]; kx, vx [1, H, T, D] (expanded over the GQA
    group); own = (index, cp), index[s] the rows of rank s -> (o [H, T, D], lse [H, T]) in
    `acc`, the same on every rank. Per own run [a, b): the causal square over [a, b) and,
    unmasked, the rows before a."""
    index, cp = own
    h, t, d = q.shape
    part = q.new_zeros(h, int(index[cp.rank].numel()), d + 1, dtype=acc)  # (H, n, D | lse)
    col = 0
    for a, b in own_runs(index[cp.rank]):
        qb = q[None, :, a:b].contiguous()
        o, lse = flash(qb, kx[:, :, a:b].contiguous(), vx[:, :, a:b].contiguous(), True, scale)
        o, lse = o[0].to(acc), lse[0].to(acc)
        if a > 0:
            o_p, lse_p = flash(qb, kx[:, :, :a].contiguous(), vx[:, :, :a].contiguous(), False, scale)
            o_p, lse_p = o_p[0].to(acc), lse_p[0].to(acc)
            o, lse = merge_partials(o_p, lse_p, o, lse), torch.logaddexp(lse_p, lse)
        part[:, col:col + b - a, :d], part[:, col:col + b - a, d] = o, lse
        col += b - a
    full = gather_rows(part, index, cp)  # (H, T, D + 1)
    return full[..., :d], full[..., d]


def _own_self_backward(backward, do, q, kx, vx, out, lse, scale: float, own, hkv: int):
    """The backward of `_own_self_part` on this rank's query rows, with the merged
    (do, out, lse) [1, H, T, ..] of the whole attention: dq [H, T, D] of its own rows
    (zeros elsewhere: their owners compute them) and dk, dv [Hkv, T, D] of every row its
    queries saw, summed over the GQA group and then over ranks (one all-reduce of
    2 Hkv T D values), so they are the whole self part's on every rank."""
    index, cp = own
    acc = accumulation_dtype(q.dtype)
    h, t, d = q.shape
    dq = torch.zeros(h, t, d, dtype=acc, device=q.device)
    dkv = torch.zeros(2, h, t, d, dtype=acc, device=q.device)
    for a, b in own_runs(index[cp.rank]):
        rows = (do[:, :, a:b].contiguous(), q[None, :, a:b].contiguous())
        tail = (out[:, :, a:b].contiguous(), lse[:, :, a:b].contiguous())
        dq_b, dk_b, dv_b = backward(*rows, kx[:, :, a:b].contiguous(), vx[:, :, a:b].contiguous(), *tail, True, scale)
        dq[:, a:b] += dq_b[0]
        dkv[0, :, a:b] += dk_b[0]
        dkv[1, :, a:b] += dv_b[0]
        if a > 0:
            dq_b, dk_b, dv_b = backward(*rows, kx[:, :, :a].contiguous(), vx[:, :, :a].contiguous(), *tail, False,
                                        scale)
            dq[:, a:b] += dq_b[0]
            dkv[0, :, :a] += dk_b[0]
            dkv[1, :, :a] += dv_b[0]
    dkv = all_reduce_sum(dkv.reshape(2, hkv, h // hkv, t, d).sum(2), cp)  # (2, Hkv, T, D)
    return dq, dkv[0], dkv[1]


class FlashAttention(torch.autograd.Function):
    """Causal attention of T new tokens over prefix segments plus themselves, fused.

    forward(q [H, T, D], k [Hkv, T, D], v [Hkv, T, D], prefixes (KVSegments, each
    k, v [Hkv, S_j, D], optional grad sinks), scale, backward_block) -> out [Hkv, M, D]
    in the accumulation dtype, row layout (head j*g + i of token t is row i*T + t of kv
    head j). Gradients go to q, k, v and into the segments' sinks. A batch of B branches
    (batched replay): q [B, H, T, D], k, v [B, Hkv, T, D], each branch causal over its own
    tokens and all of them over the same prefixes -> out [Hkv, B*g*T, D] (`rows.to_rows`).

    A segment with `cp` set is this rank's shard of a position-sharded state (context
    parallelism; every rank calls with the same queries and the same upstream gradient,
    the computation after the attention being replicated, or its output gradient summed
    over ranks first): its partial is merged across ranks in forward (`merge_across_ranks`:
    all-reduces, the same bits on every rank), and in backward this rank's part of dq over its rows is
    summed over ranks (one all-reduce), while dk, dv of its rows go into its sinks. Such a
    segment is passed even when this rank's shard is empty (every rank must join).

    `own` = (index, cp) (context parallelism's divided walk; index[s] the query rows of rank
    s): this rank computes the causal self part of its own rows only, and the ranks' self
    partials are gathered (`_own_self_part`); in backward its queries' dk, dv are summed
    over ranks, and dq of the self part is its own rows' only. The output is still every
    row's, the same on every rank.
    """

    @staticmethod
    def forward(ctx, q, k, v, prefixes, scale, backward_block, own=None):
        q4, k4, v4 = (q, k, v) if q.dim() == 4 else (q[None], k[None], v[None])  # (B, H, T, D): B branches
        b, h, t, d = q4.shape
        hkv = k4.shape[1]
        g = h // hkv
        flash = fused_kernel(q.device.type, q.dtype)
        acc = accumulation_dtype(q.dtype)
        # self part: causal over each branch's new tokens; their K/V expanded over the GQA group (T-sized)
        kx, vx = k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1)
        if own is None:
            out, lse = flash(q4, kx, vx, True, scale)  # (B, H, T, D), (B, H, T)
            out = out.to(acc)
        else:
            assert b == 1, "a divided walk runs one sequence"
            out, lse = _own_self_part(flash, q4[0], kx, vx, scale, own, acc)
            out, lse = out[None], lse[None]
        out, lse = to_rows(out, hkv), to_rows(lse, hkv)  # (Hkv, M, D), (Hkv, M): M = B*g*T
        rows = to_rows(q4, hkv)[None]  # no mask over a prefix: every branch's g query heads of a kv head are rows
        for seg in prefixes:
            if seg.k.shape[1] == 0:
                out_p, lse_p = empty_partial(q, hkv, b * g * t, v.shape[-1])
            else:
                out_p, lse_p = flash(rows, seg.k[None], seg.v[None], False, scale)
                out_p, lse_p = out_p[0].to(acc), lse_p[0]
            if seg.cp is not None:
                out_p, lse_p = merge_across_ranks(out_p, lse_p, seg.cp)
            elif seg.k.shape[1] == 0:
                continue
            out, lse = merge_partials(out_p, lse_p, out, lse), torch.logaddexp(lse_p, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefixes, ctx.scale, ctx.backward_block, ctx.own = prefixes, scale, backward_block, own
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        q4, k4, v4 = (q, k, v) if q.dim() == 4 else (q[None], k[None], v[None])
        b, h, t, d = q4.shape
        hkv = k4.shape[1]
        g = h // hkv
        backward = fused_backward_kernel(q.device.type, q.dtype)
        scale = ctx.scale
        do_rows = grad_out.to(q.dtype).reshape(1, hkv, b * g * t, d)
        out_rows = out.to(q.dtype).reshape(1, hkv, b * g * t, d)
        lse_rows = lse.reshape(1, hkv, b * g * t)
        # self part, head layout; GQA: the expanded dk, dv summed back over the group
        head = (from_rows(do_rows[0], b, h), q4, k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1),
                from_rows(out_rows[0], b, h), from_rows(lse_rows[0], b, h))
        if ctx.own is None:
            dq, dk, dv = backward(*head, True, scale)
            dq = dq.to(accumulation_dtype(q.dtype))  # (B, H, T, D)
            dk = dk.reshape(b, hkv, g, t, d).sum(2)
            dv = dv.reshape(b, hkv, g, t, d).sum(2)
        else:
            dq, dk, dv = _own_self_backward(backward, head[0], q, *head[2:], scale, ctx.own, hkv)
            dq, dk, dv = dq[None], dk[None], dv[None]
        dq_rows = to_rows(dq, hkv).contiguous()  # (Hkv, M, D): a view when B = 1
        rows = to_rows(q4, hkv)[None]
        for seg in ctx.prefixes:
            part = dq_rows if seg.cp is None else torch.zeros_like(dq_rows)  # a shard's part: summed over ranks
            sinks = (None, None) if seg.grad is None else seg.grad
            # block by block, one registered op per segment (`ops/flash_prefix.py`)
            flash_prefix_backward(do_rows, rows, seg.k, seg.v, out_rows, lse_rows, part, *sinks, scale,
                                  ctx.backward_block)
            if seg.cp is not None:
                dq_rows += all_reduce_sum(part, seg.cp)
        dq = from_rows(dq_rows, b, h)
        if q.dim() == 3:
            dq, dk, dv = dq[0], dk[0], dv[0]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def keeps_outputs(q: torch.Tensor, value_dim: int, window: int | None, sinks, sharded: bool) -> bool:
    """Whether a capture chunk's attention output and LSE can stand in for the reverse
    walk's attention forward (`ExecConfig.keep_attention_outputs`), whose backward needs
    only (q, k, v, o, lse): no sinks, and the walk's attention of these queries is either
    `FlashAttention` (a fused forward and backward for q's device and dtype, no sliding
    window: `KeptAttention`) or the blockwise kernel over an unsharded state
    (`attention.KeptPrefixAttention`: sliding windows, CUDA)."""
    if sinks is not None:
        return False
    fused = fused_takes(q, value_dim, window) and fused_backward_kernel(q.device.type, q.dtype) is not None
    return fused or not sharded


class KeptAttention(FlashAttention):
    """`FlashAttention` whose forward is already done: exact mode's reverse walk with
    kept attention outputs (`state/kept_outputs.py`).

    forward(q [H, T, D], k [Hkv, T, D], v [Hkv, T, D], prefixes, scale, backward_block,
    kept = (o [H, T, Dv], lse [H, T]) from capture) -> o [Hkv, M, Dv] (row layout, as
    `FlashAttention`): no attention is computed, the kept output is returned (a copy) and
    saved with q, k, v. The backward is `FlashAttention.backward` unchanged: the flash
    backward of the self part and of each prefix segment with the global o and lse, dk /
    dv of the prefix into the segments' sinks. Its naive twin is `FlashAttention` itself
    (the walk that attends again)."""

    @staticmethod
    def forward(ctx, q, k, v, prefixes, scale, backward_block, kept):
        out, lse = kept
        h, t, d = q.shape
        hkv = k.shape[0]
        assert out.shape[:2] == (h, t) and lse.shape == (h, t), (out.shape, lse.shape, q.shape)
        out = out.reshape(hkv, (h // hkv) * t, -1).to(accumulation_dtype(q.dtype))  # a copy unless fp32/fp64
        lse = lse.reshape(hkv, (h // hkv) * t)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefixes, ctx.scale, ctx.backward_block, ctx.own = prefixes, scale, backward_block, None
        return out.clone()
