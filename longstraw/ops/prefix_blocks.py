"""The blockwise attention kernel's two loops as registered ops:
`longstraw::prefix_attention_forward` and `longstraw::prefix_attention_backward`.

`attention.PrefixAttention` walks the keys in blocks of `block_size` positions with an
online softmax, and its backward walks them again. That is a Python loop of about ten ops
per block, per call: on CUDA the walk's autograd always runs it (torch's CUDA flash
backward is not used, `flash.fused_backward_kernel`), so at the paper's P the reverse walk
of Qwen3.6-27B calls it for every attention layer and walk chunk, over every key block of
the chunk's prefix shard and of its own keys. Profiled on a rehearsal
(`bench/rehearse_op_sites.py`, the first 4 layers at P = 262,144 on 8 ranks, chunks of
16,384) it was about 40% of the ops each extra 131,072 positions add. Registered, each
loop is one op to anything that watches ops (fake tensors in `ls.rehearse`, the live-byte
tracker, the FLOP counter): its temporaries are declared as its workspace
(`ops/workspace.py`) and its matmuls as its FLOP formula. The real implementations are the
plain loops here (`forward_blocks`, `backward_blocks`), so the numbers are the loops'
(tests/ops/test_prefix_blocks.py).

    longstraw::prefix_attention_forward(q, k, v, q_pos, k_positions?, k_first, scale, window?,
                                        block_size, causal) -> (out, lse)
    longstraw::prefix_attention_backward(q, k, v, out, lse, q_pos, k_positions?, k_first,
                                         grad_out, grad_lse?, sink_k(a!)?, sink_v(b!)?, need_dk,
                                         need_dv, scale, window?, block_size, causal) -> (dq, dk, dv)

Shapes: q [Hkv, M, D] query rows (M = g*T), k [Hkv, S, D], v [Hkv, S, Dv] (views of the
state, read in place); q_pos [M] the rows' positions; the keys' positions are
k_positions [S] where given (a shard's rows), else k_first .. k_first + S - 1; out
[Hkv, M, Dv] and lse [Hkv, M] in the accumulation dtype (rows that see no key: 0 and
-inf); grad_out like out, grad_lse like lse or None; the sinks [Hkv, S, D] / [Hkv, S, Dv]
(exact mode's gradient buffers of the state), added into, or None; dq like q, dk like k
and dv like v (empty where not needed).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.ops.workspace import declare_workspace
from longstraw.tensors import accumulation_dtype

Tensor = torch.Tensor


def window_mask(q_pos: Tensor, k_pos: Tensor, window: int | None, causal: bool) -> Tensor | None:
    """Boolean [M, N] mask, True where a query may NOT see a key (HF semantics:
    visible iff k <= q and q - k < window)."""
    masked = None
    if causal:
        masked = k_pos[None, :] > q_pos[:, None]
    if window is not None:
        far = (q_pos[:, None] - k_pos[None, :]) >= window
        masked = far if masked is None else (masked | far)
    return masked


def _key_positions(k_positions: Tensor | None, k_first: int, b0: int, b1: int, device) -> Tensor:
    """Positions [b1 - b0] of key rows b0 .. b1 - 1."""
    if k_positions is not None:
        return k_positions[b0:b1].to(device)
    return torch.arange(k_first + b0, k_first + b1, device=device)


def _scores(qa, kb, q_pos, k_positions, k_first, b0, b1, scale, window, causal) -> Tensor:
    """The masked scores [Hkv, M, B] of the query rows over key block b0 .. b1 - 1."""
    scores = torch.matmul(qa, kb.transpose(1, 2)).mul_(scale)
    if window is not None or causal:
        k_pos = _key_positions(k_positions, k_first, b0, b1, qa.device)
        scores.masked_fill_(window_mask(q_pos, k_pos, window, causal), float("-inf"))
    return scores


def forward_blocks(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_positions: Tensor | None, k_first: int,
                   scale: float, window: int | None, block_size: int, causal: bool) -> tuple[Tensor, Tensor]:
    """The forward loop (the op's real implementation): an online softmax over the key
    blocks -> (out [Hkv, M, Dv], lse [Hkv, M]) in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    qa = q.to(acc)
    hkv, m_rows, _ = q.shape
    s_len = k.shape[1]
    row_max = torch.full((hkv, m_rows), float("-inf"), dtype=acc, device=q.device)
    denom = torch.zeros(hkv, m_rows, dtype=acc, device=q.device)
    out = torch.zeros(hkv, m_rows, v.shape[2], dtype=acc, device=q.device)
    for b0 in range(0, s_len, block_size):
        b1 = min(s_len, b0 + block_size)
        scores = _scores(qa, k[:, b0:b1].to(acc), q_pos, k_positions, k_first, b0, b1, scale, window, causal)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        probs = scores.sub_(safe_max[..., None]).exp_()  # (Hkv, M, B), in place: one tile
        del scores
        rescale = torch.exp(row_max - safe_max)
        denom = denom * rescale + probs.sum(dim=-1)
        out = out * rescale[..., None] + torch.matmul(probs, v[:, b0:b1].to(acc))
        row_max = new_max
        del probs, safe_max, rescale  # before the next block's: one block's temporaries at a time
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    out = out / torch.where(denom == 0, torch.ones_like(denom), denom)[..., None]
    lse = safe_max + torch.log(denom)  # -inf where no key was visible
    return out, lse


def backward_blocks(q, k, v, out, lse, q_pos, k_positions, k_first: int, grad_out, grad_lse, sink_k, sink_v,
                    need_dk: bool, need_dv: bool, scale: float, window: int | None, block_size: int,
                    causal: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The backward loop (the op's real implementation): per key block the probabilities
    again, dq accumulated, dk / dv of the block written and added into the sinks."""
    acc = out.dtype
    qa = q.to(acc)
    grad_out = grad_out.to(acc)
    delta = (grad_out * out).sum(dim=-1)  # (Hkv, M)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc)
    # +inf where no key was visible, so exp(s - lse) is 0 there, never NaN.
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)
    dq = torch.zeros(qa.shape, dtype=acc, device=qa.device)  # contiguous, as the op's fake
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device) if need_dk else None
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device) if need_dv else None
    for b0 in range(0, k.shape[1], block_size):
        b1 = min(k.shape[1], b0 + block_size)
        kb, vb = k[:, b0:b1].to(acc), v[:, b0:b1].to(acc)
        # two [Hkv, M, B] tiles at a time: the scores become the probabilities in place,
        # and dP becomes dS in place
        probs = _scores(qa, kb, q_pos, k_positions, k_first, b0, b1, scale, window, causal).sub_(lse[..., None]).exp_()
        dscores = torch.matmul(grad_out, vb.transpose(1, 2)).sub_(delta[..., None]).mul_(probs)  # (Hkv, M, B)
        dq += torch.matmul(dscores, kb) * scale
        if need_dk or need_dv or sink_k is not None:
            dk_block = torch.matmul(dscores.transpose(1, 2), qa) * scale  # (Hkv, B, D)
            dv_block = torch.matmul(probs.transpose(1, 2), grad_out)  # (Hkv, B, Dv)
            if sink_k is not None:
                sink_k[:, b0:b1] += dk_block.to(sink_k.dtype)
                sink_v[:, b0:b1] += dv_block.to(sink_v.dtype)
            if need_dk:
                dk[:, b0:b1] = dk_block.to(k.dtype)
            if need_dv:
                dv[:, b0:b1] = dv_block.to(v.dtype)
            del dk_block, dv_block
        del probs, dscores, kb, vb  # before the next block's: one block's temporaries at a time
    return dq.to(q.dtype), dk, dv


@torch.library.custom_op("longstraw::prefix_attention_forward", mutates_args=())
def prefix_attention_forward(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_positions: Tensor | None,
                             k_first: int, scale: float, window: int | None, block_size: int,
                             causal: bool) -> tuple[Tensor, Tensor]:
    return forward_blocks(q, k, v, q_pos, k_positions, k_first, scale, window, block_size, causal)


@prefix_attention_forward.register_fake
def _(q, k, v, q_pos, k_positions, k_first, scale, window, block_size, causal):
    acc = accumulation_dtype(q.dtype)
    hkv, m, _ = q.shape
    return q.new_empty(hkv, m, v.shape[2], dtype=acc), q.new_empty(hkv, m, dtype=acc)


@torch.library.custom_op("longstraw::prefix_attention_backward", mutates_args=("sink_k", "sink_v"))
def prefix_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_pos: Tensor,
                              k_positions: Tensor | None, k_first: int, grad_out: Tensor, grad_lse: Tensor | None,
                              sink_k: Tensor | None, sink_v: Tensor | None, need_dk: bool, need_dv: bool,
                              scale: float, window: int | None, block_size: int,
                              causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = backward_blocks(q, k, v, out, lse, q_pos, k_positions, k_first, grad_out, grad_lse, sink_k, sink_v,
                                 need_dk, need_dv, scale, window, block_size, causal)
    return dq, (k.new_empty(0) if dk is None else dk), (v.new_empty(0) if dv is None else dv)


@prefix_attention_backward.register_fake
def _(q, k, v, out, lse, q_pos, k_positions, k_first, grad_out, grad_lse, sink_k, sink_v, need_dk, need_dv, scale,
      window, block_size, causal):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            k.new_empty(k.shape if need_dk else (0,)), v.new_empty(v.shape if need_dv else (0,)))


def _size(dtype: torch.dtype) -> int:
    """Bytes of one value of a floating `dtype` (no tensor made: the workspace runs per op)."""
    return torch.finfo(dtype).bits // 8


def _cast(x: Tensor, acc: torch.dtype, numel: int) -> int:
    """Bytes of `numel` values of x cast to acc (0 where x is already acc: `.to` returns x)."""
    return 0 if x.dtype == acc else numel * _size(acc)


def _masks(m: int, b: int, window, causal: bool) -> int:
    """Bytes of a block's mask (`window_mask`): the key positions (int64 [B]) and [M, B]
    bools, causal; with a window also q - k (int64 [M, B]) and the far bools (and their OR)."""
    if window is None:
        return m * b + b * 8 if causal else 0
    return m * b * (int(causal) + 8 + 1) + b * 8


def forward_workspace(q, k, v, q_pos, k_positions, k_first, scale, window, block_size, causal) -> int:
    """The most bytes `forward_blocks` holds at once beyond its inputs (R = Hkv x M and
    O = Hkv x M x Dv accumulation-dtype values): the queries' cast, the running max,
    denominator (2R) and output (O) throughout; then the larger of a block's scoring (the
    score tile [Hkv, M, B], the block's K cast, its mask) and its update (the tile, now P,
    the new max, safe max and rescale (3R), and the output's rescaled copy, P V and their
    sum (3O), the V cast alive only until P V)."""
    if k.shape[1] == 0:
        return 0
    acc = accumulation_dtype(q.dtype)
    (hkv, m, d), b, dv, a = q.shape, min(block_size, k.shape[1]), v.shape[2], _size(acc)
    rows, outs, tile = hkv * m * a, hkv * m * dv * a, hkv * m * b * a
    held = _cast(q, acc, hkv * m * d) + 2 * rows + outs
    scoring = tile + _cast(k, acc, hkv * b * d) + _masks(m, b, window, causal)
    update = tile + 3 * rows + max(_cast(v, acc, hkv * b * dv) + 2 * outs, 3 * outs)
    return held + max(scoring, update)


def backward_workspace(q, k, v, out, lse, q_pos, k_positions, k_first, grad_out, grad_lse, sink_k, sink_v, need_dk,
                       need_dv, scale, window, block_size, causal) -> int:
    """The most bytes `backward_blocks` holds at once beyond its inputs: the queries' and
    dO's casts, delta and the +inf-patched lse, dq in the accumulation dtype and the dK /
    dV it returns, throughout; per block the K and V casts and the P tile, with the largest
    of: the scoring's mask, the dS tile with dS K and its scaled copy, and (any key
    gradient) the dS tile with dK and its scaled copy or with dK, dV and dK's cast into the
    sink's or the keys' dtype; at the end dq's cast to q's dtype."""
    if k.shape[1] == 0:
        return 0
    acc = out.dtype
    (hkv, m, d), b, dv, a = q.shape, min(block_size, k.shape[1]), v.shape[2], out.element_size()
    tile, dq = hkv * m * b * a, hkv * m * d * a
    held = _cast(q, acc, hkv * m * d) + _cast(grad_out, acc, hkv * m * dv) + 2 * hkv * m * a + dq
    held += (k.numel() * k.element_size() if need_dk else 0) + (v.numel() * v.element_size() if need_dv else 0)
    block = _cast(k, acc, hkv * b * d) + _cast(v, acc, hkv * b * dv) + tile
    steps = [_masks(m, b, window, causal), tile + 2 * dq]
    if need_dk or need_dv or sink_k is not None:
        casts = [x for x, want in ((sink_k, sink_k is not None), (k, need_dk)) if want and x.dtype != acc]
        cast = max((hkv * b * d * x.element_size() for x in casts), default=0)
        steps.append(tile + hkv * b * a * max(2 * d, d + dv) + cast)
    end = 0 if q.dtype == acc else hkv * m * d * q.element_size()
    return held + max(block + max(steps), end)


PREFIX_ATTENTION_FORWARD = torch.ops.longstraw.prefix_attention_forward.default
PREFIX_ATTENTION_BACKWARD = torch.ops.longstraw.prefix_attention_backward.default
declare_workspace(PREFIX_ATTENTION_FORWARD, forward_workspace)
declare_workspace(PREFIX_ATTENTION_BACKWARD, backward_workspace)


@register_flop_formula(torch.ops.longstraw.prefix_attention_forward)
def _forward_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:
    """The loop's two matmuls a block, as the counter counts them: Q K^T and P V,
    2 x Hkv x M x S x (D + Dv)."""
    hkv, m, d = q_shape
    return 2 * hkv * m * k_shape[1] * (d + v_shape[2])


@register_flop_formula(torch.ops.longstraw.prefix_attention_backward)
def _backward_flops(q_shape, k_shape, v_shape, o_shape, lse_shape, q_pos_shape, k_positions_shape, k_first,
                    grad_out_shape, grad_lse_shape, sink_k_shape, sink_v_shape, need_dk, need_dv, *args, **kwargs) -> int:
    """Q K^T again, dO V^T and dS K a block (2 x Hkv x M x S x (2D + Dv)); with any key
    gradient also dS^T Q and P^T dO (2 x Hkv x M x S x (D + Dv))."""
    hkv, m, d = q_shape
    s, dv = k_shape[1], v_shape[2]
    keys = need_dk or need_dv or sink_k_shape is not None
    return 2 * hkv * m * s * (2 * d + dv) + (2 * hkv * m * s * (d + dv) if keys else 0)
