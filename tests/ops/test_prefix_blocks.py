"""The blockwise attention kernel's loops as registered ops (`ops/prefix_blocks.py`): each
op equals its plain loop bit for bit (float64: causal, a window, a shard's key positions,
gradient sinks) and counts the loop's FLOPs, a fake call is one op whose declared workspace
covers the loop's measured peak, and on fake tensors `PrefixAttention` is two ops however
many key blocks it walks. (`tests/ops/test_attention.py` checks the kernel against naive
attention and HF's.)"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.ops.attention import PrefixAttention
from longstraw.ops.prefix_blocks import (backward_blocks, backward_workspace, forward_blocks, forward_workspace,
                                         prefix_attention_backward, prefix_attention_forward)
from longstraw.rehearsal.tracker import LiveBytes
from tests.op_checks import assert_op_is_its_loop

HKV, M, S, D, DV, BLOCK = 2, 12, 37, 8, 6, 16  # S = 2 full blocks + 5
CASES = {"plain": (None, False, False), "causal": (None, True, False), "window": (9, True, False),
         "shard": (None, True, True)}


def _inputs(dtype, case, seed=0):
    window, causal, shard = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = mk(HKV, M, D), mk(HKV, S + 3, D)[:, :S], mk(HKV, S + 3, DV)[:, :S]  # views of a longer state
    k_first = 4
    q_pos = torch.arange(M) % 6 + k_first + S - 20  # two heads' rows a kv head, some before every key
    k_positions = (torch.arange(S) * 2 + k_first) if shard else None  # a shard's rows: not consecutive
    return [q, k, v, q_pos, k_positions, k_first, 0.3, window, BLOCK, causal]


def _backward_args(fwd, sinks: bool, seed=1):
    q, k, v, q_pos, k_positions, k_first, scale, window, block, causal = fwd
    out, lse = forward_blocks(*fwd)
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(lse.dtype)
    acc = out.dtype
    sink_k = torch.randn(k.shape, generator=gen, dtype=torch.float64).to(acc) if sinks else None
    sink_v = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(acc) if sinks else None
    return [q, k, v, out, lse, q_pos, k_positions, k_first, grad_out, grad_lse, sink_k, sink_v, True, not sinks,
            scale, window, block, causal]


@pytest.mark.parametrize("case", list(CASES))
def test_each_op_equals_its_loop_bit_for_bit_and_counts_its_flops(case):
    fwd = _inputs(torch.float64, case)
    for a, b in zip(prefix_attention_forward(*fwd), forward_blocks(*fwd), strict=True):
        assert torch.equal(a, b)
    assert_op_is_its_loop(prefix_attention_forward, forward_blocks, fwd, mutated=[])
    for sinks in (False, True):
        args = _backward_args(fwd, sinks)
        mine = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = prefix_attention_backward(*mine)
        ref = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = backward_blocks(*ref)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert (got[2].numel() == 0 and want[2] is None) if sinks else torch.equal(got[2], want[2])
        if sinks:
            assert torch.equal(mine[10], ref[10]) and torch.equal(mine[11], ref[11])
            assert not torch.equal(mine[10], args[10])  # something was added into the sink
        assert_op_is_its_loop(lambda *a: prefix_attention_backward(*a),
                              lambda *a: backward_blocks(*a), args, mutated=[10, 11] if sinks else [])


def _loop_peak(fn, args) -> int:
    """The plain loop's peak above its inputs (its outputs included while it builds them),
    measured by the tracker: what the op's workspace must cover, since the tracker counts
    an op's outputs only once it returns."""
    tracker = LiveBytes("cpu")
    tracker.adopt([a for a in args if isinstance(a, torch.Tensor)])
    before = tracker.live
    with tracker, tracker.phase("walk"):
        fn(*args)
    return tracker.phase_peaks["walk"] - before


def _fake_call(op, args) -> tuple[int, list]:
    """(ops the tracker saw, the fake arguments) of one call of `op` on fake copies of `args`."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        tracker = LiveBytes("cpu")
        with tracker, tracker.phase("walk"):
            op(*fake)
    return tracker.ops, fake


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", ["plain", "causal", "window"])
def test_a_fake_call_is_one_op_whose_workspace_covers_the_loop(dtype, case):
    fwd = _inputs(dtype, case, seed=2)
    loop = _loop_peak(forward_blocks, fwd)
    ops, fake = _fake_call(prefix_attention_forward, fwd)
    declared = forward_workspace(*fake)
    assert ops == 1
    assert loop <= declared <= 1.1 * loop, (loop, declared)
    for sinks in (False, True):
        args = _backward_args(fwd, sinks)
        loop = _loop_peak(backward_blocks, args)
        ops, fake = _fake_call(prefix_attention_backward, args)
        declared = backward_workspace(*fake)
        assert ops == 1
        assert loop <= declared <= 1.1 * loop, (sinks, loop, declared)


def test_on_fake_tensors_the_kernel_is_two_ops_however_many_blocks():
    counts = []
    for s in (64, 640):
        with FakeTensorMode() as mode:
            q = torch.empty(HKV, M, D, dtype=torch.bfloat16).requires_grad_()
            k, v = torch.empty(HKV, s, D, dtype=torch.bfloat16), torch.empty(HKV, s, DV, dtype=torch.bfloat16)
            sink = (torch.zeros(HKV, s, D), torch.zeros(HKV, s, DV))
            tracker = LiveBytes("cpu")
            with tracker, tracker.phase("walk"):
                out, _ = PrefixAttention.apply(q, k, v, torch.arange(M) + s, 0, 0.3, None, BLOCK, sink, False)
                out.sum().backward()
        assert mode is not None and q.grad.shape == q.shape
        counts.append(tracker.ops)
    assert counts[0] == counts[1], counts


def test_a_checkpointed_layer_holds_none_of_its_own_keys_until_its_backward():
    """Keys and values made in the graph (a walk chunk's or a piece's own, which require grad)
    are saved tensors, so torch's checkpoint (layer recompute) holds none of them between a
    layer's forward and its backward: after the forward of 6 checkpointed layers only their
    inputs and outputs are alive, not 6 layers' keys and values. Red while `PrefixAttention`
    held every k / v on its ctx (6 x the keys and values alive: the exact walk under layer
    recompute kept every attention layer's gathered q/k/v, 0.25 GiB a layer at the paper's
    chunk of 16,384). The gradients are unchanged (float64, against the unsaved layers)."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(HKV, M, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(D, D + DV, generator=gen, dtype=torch.float64) for _ in range(6)]
    q_pos = torch.arange(M)

    def layer(h, w):
        kv = h @ w  # (HKV, M, D + DV): this layer's own keys and values, in the graph
        out, _ = PrefixAttention.apply(h, kv[..., :D], kv[..., D:], q_pos, 0, 0.3, None, BLOCK, None, True)
        return h + torch.nn.functional.pad(out, (0, D - DV))  # DV < D here

    def run(ckpt: bool):
        h = x
        for w in weights:
            h = checkpoint(layer, h, w, use_reentrant=False) if ckpt else layer(h, w)
        return h

    tracker = LiveBytes("cpu")
    tracker.adopt([x, *weights, q_pos])
    with tracker:
        before = tracker.live
        h = run(True)
        held = tracker.live - before
        (g,) = torch.autograd.grad(h.sum(), x)
    kv_bytes = HKV * M * (D + DV) * 8
    assert held < 6 * kv_bytes, (held, kv_bytes)  # the inputs and outputs, far under 6 layers' k / v
    (want,) = torch.autograd.grad(run(False).sum(), x)
    assert torch.allclose(g, want, rtol=1e-12, atol=1e-12)
