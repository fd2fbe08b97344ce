"""DSA's sparse attention over the MLA latent, block by block, as two registered ops:
`longstraw::sparse_latent_forward` and `longstraw::sparse_latent_backward`.

`dsa.SparseLatentAttention` attends each block of `query_block` queries to its K selected
rows, gathered from the prefix segments and the new tokens (`dsa_plan.BlockPlan`). At the
paper's lengths that is a Python loop of a few dozen ops per block: per layer, per chunk of
the capture and per piece of the replay. Profiled on a GLM-5.2 rehearsal
(`bench/rehearse_op_sites.py`, 4 layers at P = 65,536 on 32 ranks) it was 57% of all ops.
Registered, each pass is one op to anything that watches ops (fake tensors in
`ls.rehearse`, the live-byte tracker, the FLOP counter): its temporaries are declared as
its workspace (`ops/workspace.py`) and its matmuls as its FLOP formula. The real
implementations are the plain loops here (`forward_blocks`, `backward_blocks`), so the
numbers are the loops' (tests/ops/test_sparse_latent.py).

    longstraw::sparse_latent_forward(q, k_new, v_new, indices, seg_k[], seg_v[], starts[],
                                     q_start, scale, query_block, out(a!), lse(b!)) -> ()
    longstraw::sparse_latent_backward(q, k_new, v_new, indices, lse, grad_out, delta, seg_k[],
                                      seg_v[], starts[], sink_k(a!)[], sink_v(b!)[], q_start,
                                      scale, query_block, dq(c!), dk_new(d!)?, dv_new(e!)?) -> ()

Shapes: q [H, T, D]; k_new [T, D], v_new [T, Dv] (v_new may be a view of k_new[:, :Dv]);
indices [T, K] int64 absolute positions (-1 = none); seg_k[j] [S_j, D], seg_v[j] [S_j, Dv]
(views of the state, v a view of k's first Dv columns in the latent layout) starting at
starts[j]; out [H, T, Dv] and lse [H, T] (accumulation dtype, written); grad_out [H, T, Dv]
(accumulation dtype), delta [H, T] = rowsum(dO * O) - dLSE, lse with +inf where a row has
no index; sink_k[j] [S_j, D] / sink_v[j] [S_j, Dv] the segments' gradient sinks, added into
(an empty tensor: no sink; sink_v[j] may be a view of sink_k[j]'s first Dv columns); dq
[H, T, D], dk_new [T, D], dv_new [T, Dv] (accumulation dtype), added into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.ops.dsa_plan import BlockPlan, check_indices, dummy_rows, entry_bounds, primary_source
from longstraw.ops.workspace import declare_workspace

Tensor = torch.Tensor


def is_leading_columns(part: Tensor, whole: Tensor) -> bool:
    """True when `part` is the view whole[..., :part.shape[-1]] (same memory, same strides)."""
    return (part.device == whole.device and part.dtype == whole.dtype and part.dim() == whole.dim()
            and torch._C._is_alias_of(part, whole)
            and part.storage_offset() == whole.storage_offset() and part.stride() == whole.stride()
            and part.shape[:-1] == whole.shape[:-1] and part.shape[-1] <= whole.shape[-1])


@dataclass
class Source:
    """A run of key/value rows at absolute positions start .. start + n - 1: a prefix segment
    (k [n, D], v [n, Dv], its sink rows or None) or, last in the list, the new tokens."""

    k: Tensor
    v: Tensor
    start: int
    sink: tuple | None = None


def _sources(k_new, v_new, seg_k, seg_v, starts, q_start, sink_k=None, sink_v=None) -> list[Source]:
    out = []
    for j, (k, v, s) in enumerate(zip(seg_k, seg_v, starts)):
        sink = None if sink_k is None or sink_k[j].numel() == 0 else (sink_k[j], sink_v[j])
        out.append(Source(k, v, int(s), sink))
    out.append(Source(k_new, v_new, q_start))
    return out


def _block_rows(plan, sources, latent, kbuf, vbuf, bsz, kk):
    """Gathered keys [B, K, D] and values [B, K, Dv] of a block (values a view of keys if latent)."""
    kb = plan.gather(sources, "k", kbuf).view(bsz, kk, -1)
    if latent:
        return kb, kb[..., :sources[-1].v.shape[1]]
    return kb, plan.gather(sources, "v", vbuf).view(bsz, kk, -1)


def _buffers(sources, latent, bmax, kk, acc, device, grads: bool):
    """The gather buffers of bmax * K entries plus the dummy row: (keys, values or None,
    and with `grads` their gradient twins, else None, None)."""
    rows = bmax * kk + dummy_rows
    d, dv = sources[-1].k.shape[1], sources[-1].v.shape[1]

    def empty(width):
        return torch.empty(rows, width, dtype=acc, device=device)

    return empty(d), None if latent else empty(dv), empty(d) if grads else None, empty(dv) if grads else None


def forward_blocks(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, scale, query_block, out, lse) -> None:
    """The plain forward loop (the op's implementation): out [H, T, Dv] and lse [H, T] of
    each query's attention over its selected rows (zeros / -inf for a row with none)."""
    acc = out.dtype
    t, kk = q.shape[1], indices.shape[1]
    sources = _sources(k_new, v_new, seg_k, seg_v, starts, q_start)
    latent = all(is_leading_columns(s.v, s.k) for s in sources)
    check_indices(indices, sources, q_start)
    kbuf, vbuf, _, _ = _buffers(sources, latent, min(t, query_block), kk, acc, q.device, grads=False)
    primary = primary_source(sources)
    for b0 in range(0, t, query_block):
        b1 = min(t, b0 + query_block)
        plan = BlockPlan(indices[b0:b1], sources, entry_bounds(sources, b0, b1, kk), primary)
        kb, vb = _block_rows(plan, sources, latent, kbuf, vbuf, b1 - b0, kk)
        qb = q[:, b0:b1].to(acc).transpose(0, 1)  # [B, H, D]
        scores = torch.matmul(qb, kb.transpose(1, 2)).mul_(scale)  # [B, H, K]
        scores.masked_fill_(~plan.valid[:, None, :], float("-inf"))
        row_max = scores.amax(dim=-1)
        safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        probs = scores.sub_(safe_max[..., None]).exp_()
        denom = probs.sum(dim=-1)
        ob = torch.matmul(probs, vb) / torch.where(denom == 0, torch.ones_like(denom), denom)[..., None]
        out[:, b0:b1] = ob.transpose(0, 1)
        lse[:, b0:b1] = (safe_max + torch.log(denom)).transpose(0, 1)  # -inf for a row with no index
        del plan, kb, vb, qb, scores, row_max, safe_max, probs, denom, ob


def backward_blocks(q, k_new, v_new, indices, lse, grad_out, delta, seg_k, seg_v, starts, sink_k, sink_v, q_start,
                    scale, query_block, dq, dk_new, dv_new) -> None:
    """The plain backward loop (the op's implementation): recomputes each block's
    probabilities from lse and adds the gradients into dq, dk_new / dv_new (None: not
    wanted) and the segments' sinks."""
    acc = dq.dtype
    t, kk = q.shape[1], indices.shape[1]
    d, dv = k_new.shape[1], v_new.shape[1]
    sources = _sources(k_new, v_new, seg_k, seg_v, starts, q_start, sink_k, sink_v)
    latent = all(is_leading_columns(s.v, s.k) for s in sources)
    targets = [s.sink for s in sources[:-1]] + [(dk_new, dv_new)]
    need_rows = dk_new is not None or dv_new is not None or any(s.sink is not None for s in sources[:-1])
    kbuf, vbuf, dkbuf, dvbuf = _buffers(sources, latent, min(t, query_block), kk, acc, q.device, grads=need_rows)
    primary = primary_source(sources)
    tk, tv = targets[primary] or (None, None)
    latent_sink = tk is not None and tv is not None and is_leading_columns(tv, tk)  # one scatter adds both
    for b0 in range(0, t, query_block):
        b1 = min(t, b0 + query_block)
        bsz = b1 - b0
        plan = BlockPlan(indices[b0:b1], sources, entry_bounds(sources, b0, b1, kk), primary)
        kb, vb = _block_rows(plan, sources, latent, kbuf, vbuf, bsz, kk)
        qb = q[:, b0:b1].to(acc).transpose(0, 1)  # [B, H, D]
        scores = torch.matmul(qb, kb.transpose(1, 2)).mul_(scale)  # [B, H, K]
        scores.masked_fill_(~plan.valid[:, None, :], float("-inf"))
        probs = scores.sub_(lse[:, b0:b1].transpose(0, 1)[..., None]).exp_()
        gob = grad_out[:, b0:b1].transpose(0, 1)  # [B, H, Dv]
        dscores = torch.matmul(gob, vb.transpose(1, 2))
        dscores.sub_(delta[:, b0:b1].transpose(0, 1)[..., None]).mul_(probs)
        dq[:, b0:b1] += torch.matmul(dscores, kb).mul_(scale).transpose(0, 1)
        if need_rows:
            n = bsz * kk
            torch.bmm(dscores.transpose(1, 2), qb, out=dkbuf[:n].view(bsz, kk, d)).mul_(scale)
            torch.bmm(probs.transpose(1, 2), gob, out=dvbuf[:n].view(bsz, kk, dv))
            dkbuf[n].zero_()  # the dummy entry the plan's padding slots add from
            dvbuf[n].zero_()
            plan.scatter(targets, dkbuf[:n + 1], dvbuf[:n + 1], latent_sink)
        del plan, kb, vb, qb, scores, probs, gob, dscores


@torch.library.custom_op("longstraw::sparse_latent_forward", mutates_args=("out", "lse"))
def sparse_latent_forward(q: Tensor, k_new: Tensor, v_new: Tensor, indices: Tensor, seg_k: list[Tensor],
                          seg_v: list[Tensor], starts: list[int], q_start: int, scale: float, query_block: int,
                          out: Tensor, lse: Tensor) -> None:
    forward_blocks(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, scale, query_block, out, lse)


@sparse_latent_forward.register_fake
def _(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, scale, query_block, out, lse):
    return None


@torch.library.custom_op("longstraw::sparse_latent_backward", mutates_args=("sink_k", "sink_v", "dq", "dk_new", "dv_new"))
def sparse_latent_backward(q: Tensor, k_new: Tensor, v_new: Tensor, indices: Tensor, lse: Tensor, grad_out: Tensor,
                           delta: Tensor, seg_k: list[Tensor], seg_v: list[Tensor], starts: list[int],
                           sink_k: list[Tensor], sink_v: list[Tensor], q_start: int, scale: float, query_block: int,
                           dq: Tensor, dk_new: Tensor | None, dv_new: Tensor | None) -> None:
    backward_blocks(q, k_new, v_new, indices, lse, grad_out, delta, seg_k, seg_v, starts, sink_k, sink_v, q_start,
                    scale, query_block, dq, dk_new, dv_new)


@sparse_latent_backward.register_fake
def _(q, k_new, v_new, indices, lse, grad_out, delta, seg_k, seg_v, starts, sink_k, sink_v, q_start, scale,
      query_block, dq, dk_new, dv_new):
    return None


# ---------------------------------------------------------------------------------------------
# workspace: the temporaries of the plain loops, declared to the live-byte tracker


def _block_starts(t: int, query_block: int) -> list[int]:
    """The blocks whose plan is largest: the first, the last full one and the last (the new
    tokens' causal bound grows with the block's rows, so one of these holds the most entries)."""
    last = (t - 1) // query_block * query_block
    return sorted({0, max(0, (t // query_block - 1) * query_block), last})


def _plan_bytes(sources: list, b0: int, b1: int, kk: int) -> tuple[int, int, int]:
    """(bytes a `BlockPlan` of rows b0..b1 keeps, the most it adds while it is built, the
    largest non-primary bound): int64 primary rows [n], per other source its entry ids and
    rows [bound] (int64), the in-primary and valid masks [n] (bool)."""
    n = (b1 - b0) * kk
    primary = primary_source(sources)
    bounds = [b for j, b in enumerate(entry_bounds(sources, b0, b1, kk)) if j != primary]
    big = max(bounds, default=0)
    return 8 * n + 16 * sum(bounds) + 2 * n, 3 * n + 16 * big, big


def _rows_and_cast(x: Tensor, acc: int) -> int:
    """Bytes per gathered row of x: the row in x's dtype, and its cast where that is not the accumulation dtype."""
    return x.shape[1] * (x.element_size() + (0 if x.element_size() == acc else acc))


def _gather_bytes(sources: list, latent: bool, big: int, n: int, acc: int) -> int:
    """The most a block's gather holds at once: the primary source's rows [n, width] in its
    dtype (where it is not the accumulation dtype: `index_select` cannot write across
    dtypes), or a non-primary source's [bound, width] rows and their cast, plus the
    inverted valid mask [n] (bool)."""
    primary = sources[primary_source(sources)]
    out = 0
    for attr in ("k",) if latent else ("k", "v"):
        x = getattr(primary, attr)
        own = 0 if x.element_size() == acc and x.dtype.is_floating_point else n * x.shape[1] * x.element_size()
        others = max((big * _rows_and_cast(getattr(s, attr), acc) for s in sources if s is not primary), default=0)
        out = max(out, own, others)
    return out + n


def _geometry(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, query_block):
    """(sources, latent, accumulation bytes, [(B, n, plan kept, plan build, largest bound)] per candidate block)."""
    sources = _sources(k_new, v_new, seg_k, seg_v, starts, q_start)
    latent = all(is_leading_columns(s.v, s.k) for s in sources)
    acc = 8 if q.dtype == torch.float64 else 4
    t, kk = q.shape[1], indices.shape[1]
    blocks = []
    for b0 in _block_starts(t, query_block):
        b1 = min(t, b0 + query_block)
        blocks.append(((b1 - b0), (b1 - b0) * kk, *_plan_bytes(sources, b0, b1, kk)))
    return sources, latent, acc, blocks


def forward_workspace(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, scale, query_block, out, lse) -> int:
    """The most bytes `forward_blocks` holds at once (an upper bound, within a few percent:
    tests/ops/test_sparse_latent.py): the larger of the indices' check (five [T, K] masks and
    a [T] range) and the gather buffers with one block's plan, beside either its gather or
    its q cast [B, H, D], scores [B, H, K], softmax statistics [B, H] and the two [B, H, Dv]
    products of the output's division."""
    h, t, d = q.shape
    if t == 0:
        return 0
    sources, latent, acc, blocks = _geometry(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, query_block)
    kk, dv = indices.shape[1], v_new.shape[1]
    check = 5 * t * kk + 8 * t
    bufs = (min(t, query_block) * kk + dummy_rows) * (d + (0 if latent else dv)) * acc
    qcast = 0 if q.element_size() == acc else h * d * acc
    peak = 0
    for b, n, kept, build, big in blocks:
        gather = _gather_bytes(sources, latent, big, n, acc)
        attend = b * qcast + b * h * kk * acc + n + 2 * b * h * dv * acc + 4 * b * h * acc
        peak = max(peak, kept + max(build, gather, attend))
    return max(check, bufs + peak)


def backward_workspace(q, k_new, v_new, indices, lse, grad_out, delta, seg_k, seg_v, starts, sink_k, sink_v, q_start,
                       scale, query_block, dq, dk_new, dv_new) -> int:
    """The most bytes `backward_blocks` holds at once (an upper bound, as the forward's): the
    gather buffers and, where any gradient of the rows is wanted, their gradient twins, with
    one block's plan, beside either its gather or its q cast, recomputed probabilities and
    dS [B, H, K] each, and the larger of dq's product [B, H, D] and the scatter's rows (a
    non-primary source's [bound, width] rows and their cast to the sink's dtype, or the
    primary's cast [n, width])."""
    h, t, d = q.shape
    if t == 0:
        return 0
    sources, latent, acc, blocks = _geometry(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, query_block)
    kk, dv = indices.shape[1], v_new.shape[1]
    sinks = [(k, v) for k, v in zip(sink_k, sink_v) if k.numel()] + [(x, None) for x in (dk_new, dv_new) if x is not None]
    width = d + (0 if latent else dv)
    rows = min(t, query_block) * kk + dummy_rows
    bufs = rows * width * acc + (rows * (d + dv) * acc if sinks else 0)
    qcast = 0 if q.element_size() == acc else h * d * acc
    cast = max((x.element_size() for pair in sinks for x in pair if x is not None and x.element_size() != acc),
               default=0)
    peak = 0
    for b, n, kept, build, big in blocks:
        gather = _gather_bytes(sources, latent, big, n, acc)
        scatter = (big * d * (acc + cast) + n + n * d * cast) if sinks else 0
        attend = b * qcast + 2 * b * h * kk * acc + n + max(b * h * d * acc, scatter)
        peak = max(peak, kept + max(build, gather, attend))
    return bufs + peak


declare_workspace(torch.ops.longstraw.sparse_latent_forward.default, forward_workspace)
declare_workspace(torch.ops.longstraw.sparse_latent_backward.default, backward_workspace)


# ---------------------------------------------------------------------------------------------
# FLOPs: the loops' matmuls, as the counter counts them unregistered


@register_flop_formula(torch.ops.longstraw.sparse_latent_forward)
def _forward_flops(q_shape, k_shape, v_shape, indices_shape, *args, **kwargs) -> int:
    """2 H T K D (scores) + 2 H T K Dv (their values)."""
    h, t, d = q_shape
    return 2 * h * t * indices_shape[1] * (d + v_shape[1])


@register_flop_formula(torch.ops.longstraw.sparse_latent_backward)
def _backward_flops(q_shape, k_shape, v_shape, indices_shape, lse_shape, grad_out_shape, delta_shape, seg_k, seg_v,
                    starts, sink_k, sink_v, q_start, scale, query_block, dq_shape, dk_shape, dv_shape, *args,
                    **kwargs) -> int:
    """2 H T K (2 D + Dv) (recomputed scores, dS, dq), and where any row gradient is wanted
    2 H T K (D + Dv) more (dK, dV of the gathered rows)."""
    h, t, d = q_shape
    dv, kk = v_shape[1], indices_shape[1]
    rows = dk_shape is not None or dv_shape is not None or any(len(s) and s[0] for s in sink_k)
    return 2 * h * t * kk * (2 * d + dv) + (2 * h * t * kk * (d + dv) if rows else 0)
