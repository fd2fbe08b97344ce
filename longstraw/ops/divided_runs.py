"""A divided capture's attention of runs of own query rows over one set of keys, merged
into the running output, as one registered op: `longstraw::divided_attention_runs`.

`parallel.attention.divided_causal_attention` attends each rank's own queries over its own
blocks (the diagonal, causal) and over every piece of every rank's keys it fetches. Each
(run of rows, keys) is a partial attention (`partial_attention`) merged by log-sum-exp into
the running (out, lse) of those rows. At the paper's P = 2.1M on 8 ranks that is thousands
of partials per layer, each a dozen ops: a Python loop that anything watching ops (fake
tensors in `ls.rehearse`, the live-byte tracker) pays for per op. As one registered op it
is one call per fetched piece (and one for the diagonal); its real implementation is the
same loop (`attend_runs`), so the numbers are the loop's (tests/ops/test_divided_runs.py).

    longstraw::divided_attention_runs(q, k, v, out(a!), lse(b!), runs, scale, causal) -> ()

Shapes: q [H, N, D] this rank's queries; k, v [Hkv, S, D] / [Hkv, S, Dv] the keys (a
fetched piece, or the own rows for the diagonal); out [Hkv, g, N, Dv] and lse [Hkv, g, N]
the running output and log-sum-exp (accumulation dtype, g = H / Hkv), merged into in place;
runs a flat list of (a, b, lo, hi): query rows a .. b - 1 attend over keys lo .. hi - 1.

The temporaries of the widest run (its query copy, the keys repeated per head on the
fused causal path, its partial output and the merge's products) live inside the op: they
are declared as its workspace (`ops/workspace.py`), so the tracker still counts them. Its
FLOPs are registered too (`torch.utils.flop_counter`): those of the partials' attention.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from longstraw.ops.attention import PrefixAttention
from longstraw.ops.flash import fused_kernel, fused_takes
from longstraw.ops.workspace import declare_workspace
from longstraw.tensors import accumulation_dtype

Tensor = torch.Tensor


def partial_attention(q, k, v, scale: float, causal: bool, window: int | None = None, q_first: int = 0, k_pos=0):
    """(o [Hkv, g*T, Dv], lse [Hkv, g*T]) of q [H, T, D] over k, v [Hkv, S, D] (row layout:
    head j*g+i is row block i of kv head j), in the accumulation dtype. With a sliding
    `window`, the queries sit at q_first .. q_first + T - 1 and the keys at `k_pos` (the
    first one's position, or LongTensor [S]: every key's)."""
    h, t, d = q.shape
    hkv = k.shape[0]
    g = h // hkv
    acc = accumulation_dtype(q.dtype)
    flash = fused_kernel(q.device.type, q.dtype) if fused_takes(q, v.shape[-1], window) else None
    if flash is not None:
        if causal:
            out, lse = flash(q[None], k.repeat_interleave(g, 0)[None], v.repeat_interleave(g, 0)[None], True, scale)
        else:
            out, lse = flash(q.reshape(1, hkv, g * t, d), k[None], v[None], False, scale)
        return out[0].reshape(hkv, g * t, -1).to(acc), lse[0].reshape(hkv, g * t).to(acc)
    rows = q.reshape(hkv, g * t, d)
    q_pos = torch.arange(q_first, q_first + t, device=q.device).repeat(g)
    return PrefixAttention.apply(rows, k, v, q_pos, k_pos, scale, window, max(1, k.shape[1]), None, causal)


def merge_into(out: Tensor, lse: Tensor, out_p: Tensor, lse_p: Tensor) -> None:
    """`flash.merge_partials` of a partial (out_p [..., Dv], lse_p [...]) into the running
    (out, lse), in place (views of the running tensors): the same two terms, summed in the
    same order. Into an empty running pair (0, -inf) it writes the partial exactly."""
    new = torch.logaddexp(lse_p, lse)
    out.copy_(torch.exp(lse_p - new)[..., None] * out_p + torch.exp(lse - new)[..., None] * out)
    lse.copy_(new)


def attend_runs(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, runs: list[int], scale: float,
                causal: bool) -> None:
    """The plain loop (the op's real implementation): each run's partial, merged into its rows."""
    hkv, g, _, dv = out.shape
    for i in range(0, len(runs), 4):
        a, b, lo, hi = runs[i:i + 4]
        o_p, lse_p = partial_attention(q[:, a:b], k[:, lo:hi], v[:, lo:hi], scale, causal)
        merge_into(out[:, :, a:b], lse[:, :, a:b], o_p.view(hkv, g, b - a, dv), lse_p.view(hkv, g, b - a))
        del o_p, lse_p  # before the next run's: one run's temporaries at a time


@torch.library.custom_op("longstraw::divided_attention_runs", mutates_args=("out", "lse"))
def divided_attention_runs(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, runs: list[int], scale: float,
                           causal: bool) -> None:
    attend_runs(q, k, v, out, lse, runs, scale, causal)


@divided_attention_runs.register_fake
def _(q, k, v, out, lse, runs, scale, causal):
    return None


def _widest(runs: list[int]) -> tuple[int, int]:
    """(most query rows, most keys) of any run."""
    return (max((runs[i + 1] - runs[i] for i in range(0, len(runs), 4)), default=0),
            max((runs[i + 3] - runs[i + 2] for i in range(0, len(runs), 4)), default=0))


def workspace_bytes(q, k, v, out, lse, runs, scale, causal) -> int:
    """The most bytes `attend_runs` holds at once, for its widest run (T rows, S keys, H
    query heads): while the partial runs, the queries' copy (T x H x D, q's dtype), the keys
    and values repeated per query head on the fused causal path (S x H x (D + Dv)), the
    kernel's output and its accumulation-dtype copy and lse; then, while it merges, the
    partial (output and lse), the merged lse, and the merge's two weighted terms and their sum
    (3 x T x H x Dv)."""
    t, s = _widest(runs)
    if t == 0:
        return 0
    h, d, dv, qb, acc = q.shape[0], q.shape[-1], v.shape[-1], q.element_size(), out.element_size()
    repeated = s * h * (d + dv) * qb if causal else 0
    attend = t * h * (d * qb + dv * (qb + acc) + acc) + repeated
    merge = t * h * (4 * dv + 2) * acc
    return max(attend, merge)


DIVIDED_ATTENTION_RUNS = torch.ops.longstraw.divided_attention_runs.default
declare_workspace(DIVIDED_ATTENTION_RUNS, workspace_bytes)


@register_flop_formula(torch.ops.longstraw.divided_attention_runs)
def _flops(q_shape, k_shape, v_shape, acc_shape, lse_shape, runs, scale, causal, *args, **kwargs) -> int:
    """The partials' attention FLOPs, as torch's formula for a fused attention counts them
    (`flop_counter.sdpa_flop_count`, the CUDA flash op's: the CPU op has none): 2 x H x T x S x
    (D + Dv) per run (a causal one not halved)."""
    h, d, dv = q_shape[0], q_shape[-1], v_shape[-1]
    return sum(2 * h * (runs[i + 1] - runs[i]) * (runs[i + 3] - runs[i + 2]) * (d + dv) for i in range(0, len(runs), 4))
