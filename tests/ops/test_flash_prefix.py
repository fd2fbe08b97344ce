"""The fused attention backward over a prefix segment as one registered op
(`ops/flash_prefix.py`): the op equals the plain block loop bit for bit (float64, with
and without sinks, a last block shorter than the rest), `FlashAttention`'s gradients
through it equal the blockwise twin's, a fake call is one op, and the live-byte tracker
counts its declared workspace."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.ops import flash
from longstraw.ops.flash_prefix import FLASH_PREFIX_BACKWARD, flash_prefix_backward, prefix_backward, workspace_bytes
from longstraw.rehearsal.tracker import LiveBytes
from longstraw.tensors import KVSegment

HKV, G, T, S, D, BLOCK = 2, 3, 5, 37, 8, 16  # S = 2 full blocks + 5


def _args(dtype, gen, sinks: bool):
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    rows, do_rows, out_rows = mk(1, HKV, G * T, D), mk(1, HKV, G * T, D), mk(1, HKV, G * T, D)
    lse_rows = mk(1, HKV, G * T) + 3.0
    k, v = mk(HKV, S + 4, D)[:, :S], mk(HKV, S + 4, D)[:, :S]  # views of a longer state, as the engine's
    dq = mk(HKV * G, T, D)
    dk, dv = (mk(HKV, S, D), mk(HKV, S, D)) if sinks else (None, None)
    return do_rows, rows, k, v, out_rows, lse_rows, dq, dk, dv


def test_the_op_equals_the_plain_loop_bit_for_bit():
    for sinks in (False, True):
        args = _args(torch.float64, torch.Generator().manual_seed(0), sinks)
        mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        flash_prefix_backward(*mine, 0.3, BLOCK)
        prefix_backward(*ref, 0.3, BLOCK)
        for i in (6, 7, 8):  # dq, dk_sink, dv_sink
            if ref[i] is not None:
                assert torch.equal(mine[i], ref[i])
                assert not torch.equal(mine[i], args[i])  # something was added


def test_flash_attention_through_the_op_matches_the_blockwise_kernel():
    """Values and grads of q, k, v and of the prefix's sinks, float64, against the
    blockwise `PrefixAttention` path (the naive twin), with the prefix in 3 blocks."""
    gen = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = mk(HKV * G, T, D), mk(HKV, T, D), mk(HKV, T, D)
    pk, pv = mk(HKV, S, D), mk(HKV, S, D)
    dout = mk(HKV * G, T, D)
    from longstraw.ops.attention import prefix_causal_attention

    results = []
    for fused in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sink = (torch.zeros_like(pk), torch.zeros_like(pv))
        seg = KVSegment(k=pk, v=pv, start=0, grad=sink)
        before, flash.BACKWARD_BLOCK = flash.BACKWARD_BLOCK, BLOCK
        try:
            out = prefix_causal_attention(*leaves, prefixes=[seg], q_start=S, scale=0.3, allow_fused=fused)
            grads = torch.autograd.grad(out, leaves, dout)
        finally:
            flash.BACKWARD_BLOCK = before
        results.append((out, *grads, *sink))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_fake_call_is_one_op_and_the_tracker_counts_its_workspace():
    args = _args(torch.bfloat16, torch.Generator().manual_seed(2), sinks=True)
    args = [a.float() if i in (6, 7, 8) else a for i, a in enumerate(args)]  # dq, sinks in float32
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) for a in args]
        tracker = LiveBytes("cpu")
        with tracker, tracker.phase("replay"):
            flash_prefix_backward(*fake, 0.3, BLOCK)
    assert tracker.ops == 1
    want = workspace_bytes(*fake, 0.3, BLOCK)
    # K and V views are not contiguous (a slice of a longer state): two copies, three flash grads, a float32 dk
    esize = 2
    assert want == (2 * HKV * BLOCK * D * esize + 2 * HKV * BLOCK * D * esize + HKV * G * T * D * esize
                    + HKV * BLOCK * D * 4)
    assert tracker.phase_peaks["replay"] == tracker.live + want
    assert FLASH_PREFIX_BACKWARD is torch.ops.longstraw.flash_prefix_backward.default
