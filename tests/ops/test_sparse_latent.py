"""DSA's sparse attention as two registered ops (`ops/sparse_latent.py`): each declared
workspace bounds its plain loop's measured peak from above within 1% (latent and separate
values, one and two prefix segments, no / separate / latent sinks, bf16 sources under a
float32 accumulation, a query block that does not divide T); on fake tensors a step's op
count does not grow with the query blocks; and the declared FLOPs are the loops' matmuls
as the counter counts them unregistered. Values and gradients against the naive formula:
tests/ops/test_dsa.py (which runs through these ops)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.ops.attention import KVSegment
from longstraw.ops.dsa import sparse_latent_attention
from longstraw.ops.sparse_latent import (backward_blocks, backward_workspace, forward_blocks, forward_workspace,
                                         sparse_latent_backward, sparse_latent_forward)
from longstraw.rehearsal.tracker import LiveBytes
from tests.op_checks import assert_op_is_its_loop

H, D, DV = 4, 24, 16


def _case(t=37, kk=9, segments=(50,), dtype=torch.float64, latent=True, sink="view", new_grads=True, seed=0):
    """Inputs of both ops, as `dsa.SparseLatentAttention` passes them: random visible indices
    (the first rows see fewer than K positions, so -1 padding), forward outputs filled in."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    seg_k, seg_v, starts, sink_k, sink_v = [], [], [], [], []
    for s in segments:
        k = mk(s, D)
        seg_k.append(k)
        seg_v.append(k[:, :DV] if latent else mk(s, DV))
        starts.append(sum(segments[:len(starts)]))
        dk = torch.zeros(s, D, dtype=acc) if sink != "none" else torch.empty(0)
        sink_k.append(dk)
        sink_v.append(dk[:, :DV] if sink == "view" else torch.zeros(s, DV, dtype=acc) if sink == "separate" else dk)
    q_start = sum(segments)
    k_new = mk(t, D)
    v_new = k_new[:, :DV] if latent else mk(t, DV)
    indices = torch.full((t, kk), -1)
    for i in range(t):
        seen = torch.randperm(q_start + i + 1, generator=gen)[:kk]
        indices[i, :len(seen)] = seen
    q = mk(H, t, D)
    out, lse = torch.zeros(H, t, DV, dtype=acc), torch.full((H, t), float("-inf"), dtype=acc)
    forward_blocks(q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, 0.3, 8, out, lse)
    grad_out = mk(H, t, DV).to(acc)
    fwd = [q, k_new, v_new, indices, seg_k, seg_v, starts, q_start, 0.3]
    bwd = [q, k_new, v_new, indices, torch.where(torch.isinf(lse), float("inf"), lse), grad_out,
           (grad_out * out).sum(-1), seg_k, seg_v, starts, sink_k, sink_v, q_start, 0.3]
    grads = [torch.zeros(H, t, D, dtype=acc)] + [torch.zeros(t, w, dtype=acc) if new_grads else None for w in (D, DV)]
    return fwd, [out, lse], bwd, grads


def _loop_peak(loop, args) -> int:
    """The plain loop's live-byte peak above what it was given (the tracker, op by op)."""
    tracker = LiveBytes("cpu")
    tracker.adopt([x for x in torch.utils._pytree.tree_leaves(args) if isinstance(x, torch.Tensor)])
    with tracker, tracker.phase("op"):
        loop(*args)
    return tracker.phase_peaks["op"] - tracker.live


CASES = [dict(), dict(latent=False), dict(sink="none", new_grads=False), dict(sink="separate"), dict(segments=(50, 20)),
         dict(segments=(5, 3), t=40), dict(dtype=torch.float32), dict(dtype=torch.bfloat16, latent=False),
         dict(t=64, kk=32, segments=(20,), sink="separate", dtype=torch.float32)]


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("kw", CASES, ids=str)
def test_the_declared_workspace_bounds_the_loop_s_peak_within_one_percent(kw, block):
    fwd, outs, bwd, grads = _case(**kw)
    peak = _loop_peak(forward_blocks, [*fwd, block, *outs])
    declared = forward_workspace(*fwd, block, *outs)
    assert peak <= declared <= 1.01 * peak, (peak, declared)
    peak = _loop_peak(backward_blocks, [*bwd, block, *grads])
    declared = backward_workspace(*bwd, block, *grads)
    assert peak <= declared <= 1.01 * peak, (peak, declared)


@pytest.mark.parametrize("new_grads", [True, False])
def test_the_declared_flops_are_the_loops_matmuls(new_grads):
    fwd, outs, bwd, grads = _case(sink="none" if not new_grads else "view", new_grads=new_grads)
    assert_op_is_its_loop(sparse_latent_forward, forward_blocks, [*fwd, 8, *outs], mutated=[-2, -1])
    assert_op_is_its_loop(sparse_latent_backward, backward_blocks, [*bwd, 8, *grads],
                          mutated=[i for i, g in zip((-3, -2, -1), grads) if g is not None])


def test_on_fake_tensors_a_step_s_ops_do_not_grow_with_query_blocks():
    def ops(block):
        kv, sink = torch.randn(1, 300, D), torch.zeros(1, 300, D)
        real = [torch.randn(H, 64, D), kv, sink, torch.randn(64, D), torch.randint(0, 300, (64, 16))]
        with FakeTensorMode() as mode:
            q, kv, sink, k_new, indices = (mode.from_tensor(x) for x in real)
            q.requires_grad_()
            k_new.requires_grad_()
            seg = KVSegment(kv, kv[..., :DV], 0, (sink, sink[..., :DV]))
            tracker = LiveBytes("cpu")
            with tracker:
                out = sparse_latent_attention(q, k_new, k_new[:, :DV], indices, prefixes=[seg], q_start=300,
                                              scale=0.3, query_block=block)
                out.sum().backward()
        assert q.grad.shape == q.shape and k_new.grad.shape == k_new.shape
        return tracker.ops

    assert ops(2) == ops(64)  # 32 query blocks or one: the same ops
