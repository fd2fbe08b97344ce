"""LSE-merged attention against the dense naive twin, in float64, through both kernels:
torch's fused flash forward/backward (`ops/flash.py`) and the blockwise torch kernel."""

import pytest
import torch

from longstraw.ops import flash
from longstraw.ops.attention import KVSegment, prefix_causal_attention
from longstraw.ops.naive import naive_attention


@pytest.fixture(params=["flash", "blockwise"], autouse=True)
def kernel(request, monkeypatch):
    """Every test runs with the fused kernels on (their backward walking the prefix in
    blocks of 3 positions, so block edges are crossed) and off."""
    monkeypatch.setattr(flash, "FUSED_ENABLED", request.param == "flash")
    monkeypatch.setattr(flash, "BACKWARD_BLOCK", 3)
    return request.param


def test_the_flash_autograd_path_is_taken_when_enabled(kernel, monkeypatch):
    calls = []
    apply = flash.FlashAttention.apply
    monkeypatch.setattr(flash.FlashAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    q, k, v, pk, pv, dout = _inputs(4, 2, 5, 11, 8, 8)
    out = prefix_causal_attention(q, k, v, prefixes=[KVSegment(pk, pv, 0)], q_start=11, scale=0.3, block_size=4)
    torch.autograd.grad(out, q, dout)
    assert len(calls) == (1 if kernel == "flash" else 0)


def _inputs(h, hkv, t, s, d, dv, seed=0, state_grad=False):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = mk(h, t, d).requires_grad_(), mk(hkv, t, d).requires_grad_(), mk(hkv, t, dv).requires_grad_()
    pk, pv = mk(hkv, s, d), mk(hkv, s, dv)
    if state_grad:
        pk.requires_grad_(), pv.requires_grad_()
    return q, k, v, pk, pv, mk(h, t, dv)


def _naive(q, k, v, pk, pv, q_start, p_start, scale, window):
    k_all, v_all = torch.cat([pk, k], 1), torch.cat([pv, v], 1)
    q_pos = torch.arange(q_start, q_start + q.shape[1])
    k_pos = torch.cat([torch.arange(p_start, p_start + pk.shape[1]), q_pos])
    return naive_attention(q, k_all, v_all, q_pos, k_pos, scale, window)


@pytest.mark.parametrize(
    "h,hkv,t,s,block,window",
    [(4, 2, 5, 13, 4, None), (2, 2, 1, 7, 100, None), (6, 2, 6, 0, 4, None),
     (4, 1, 7, 20, 3, 9), (4, 2, 3, 17, 5, 2), (3, 3, 4, 9, 9, None)],
)
@pytest.mark.parametrize("dv", [6, 8])  # the fused kernels need Dv = D; Dv < D (absorbed MLA) is blockwise
def test_matches_naive_forward_and_every_input_grad(h, hkv, t, s, block, window, dv):
    q_start, p_start, scale = s + 3, 3, 0.37
    q, k, v, pk, pv, dout = _inputs(h, hkv, t, s, 8, dv)
    out = prefix_causal_attention(q, k, v, prefixes=[KVSegment(pk, pv, p_start)], q_start=q_start,
                                  scale=scale, window=window, block_size=block)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _naive(q, k, v, pk, pv, q_start, p_start, scale, window)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_detached_state_gets_no_gradient_and_is_not_modified():
    q, k, v, pk, pv, dout = _inputs(4, 2, 5, 11, 8, 8)
    pk0, pv0 = pk.clone(), pv.clone()
    out = prefix_causal_attention(q, k, v, prefixes=[KVSegment(pk, pv, 0)], q_start=11, scale=0.3, block_size=4)
    (out * dout).sum().backward()
    assert pk.grad is None and pv.grad is None and not pk.requires_grad
    assert torch.equal(pk, pk0) and torch.equal(pv, pv0)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_state_gradient_matches_naive_when_state_requires_grad():
    q, k, v, pk, pv, dout = _inputs(4, 2, 5, 11, 8, 8, state_grad=True)
    out = prefix_causal_attention(q, k, v, prefixes=[KVSegment(pk, pv, 0)], q_start=11, scale=0.3, block_size=4)
    got = torch.autograd.grad(out, (pk, pv), dout)
    ref = _naive(q, k, v, pk, pv, 11, 0, 0.3, None)
    want = torch.autograd.grad(ref, (pk, pv), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_window_that_hides_the_whole_prefix_for_some_rows():
    # window 2: the first new token still sees the last prefix position, later ones see none.
    q, k, v, pk, pv, dout = _inputs(2, 1, 4, 6, 4, 4)
    out = prefix_causal_attention(q, k, v, prefixes=[KVSegment(pk, pv, 0)], q_start=6, scale=1.0,
                                  window=2, block_size=2)
    ref = _naive(q, k, v, pk, pv, 6, 0, 1.0, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(out, q, dout)[0]
    g2 = torch.autograd.grad(ref, q, dout)[0]
    assert torch.isfinite(g1).all()
    torch.testing.assert_close(g1, g2, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("s", [0, 1, 13])
def test_fused_forward_path_matches_blockwise_torch_path(s):
    """The no-grad fast path (torch's CPU flash kernel) against the blockwise kernel."""
    q, k, v, pk, pv, _ = _inputs(6, 2, 5, s, 8, 8)
    big = torch.randn(2, s + 7, 8, dtype=torch.float64)
    big[:, :s] = pk  # a non-contiguous view, as the preallocated state hands out
    pk = big[:, :s]
    kw = dict(prefixes=[KVSegment(pk, pv, 0)], q_start=s, scale=0.4, block_size=4)
    with torch.no_grad():
        fused = prefix_causal_attention(q, k, v, **kw)
        plain = prefix_causal_attention(q, k, v, allow_fused=False, **kw)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)


def test_gradient_sink_accumulates_state_gradient_over_calls():
    """Exact mode: two branches' dLoss/dState are summed into buffers the state owns."""
    q, k, v, pk, pv, dout = _inputs(4, 2, 5, 11, 8, 8)
    sink = (torch.zeros_like(pk), torch.zeros_like(pv))
    want_k, want_v = torch.zeros_like(pk), torch.zeros_like(pv)
    for seed in (1, 2):
        q2, k2, v2, _, _, d2 = _inputs(4, 2, 5, 11, 8, 8, seed=seed)
        out = prefix_causal_attention(q2, k2, v2, prefixes=[KVSegment(pk, pv, 0, sink)], q_start=11, scale=0.3,
                                      block_size=4)
        (out * d2).sum().backward()
        pk_, pv_ = pk.clone().requires_grad_(), pv.clone().requires_grad_()
        ref = _naive(q2, k2, v2, pk_, pv_, 11, 0, 0.3, None)
        gk, gv = torch.autograd.grad(ref, (pk_, pv_), d2)
        want_k += gk
        want_v += gv
    torch.testing.assert_close(sink[0], want_k, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(sink[1], want_v, rtol=1e-11, atol=1e-11)
    assert not pk.requires_grad and pk.grad is None


@pytest.mark.parametrize("fused", [True, False])
def test_two_segments_equal_one_concatenated_segment(fused):
    """A branch replayed in pieces attends to the prompt state and earlier pieces."""
    q, k, v, pk, pv, dout = _inputs(4, 2, 3, 12, 8, 8)
    one = [KVSegment(pk, pv, 2)]
    two = [KVSegment(pk[:, :7], pv[:, :7], 2), KVSegment(pk[:, 7:], pv[:, 7:], 9)]
    with torch.no_grad():
        a = prefix_causal_attention(q, k, v, prefixes=one, q_start=14, scale=0.5, allow_fused=fused)
        b = prefix_causal_attention(q, k, v, prefixes=two, q_start=14, scale=0.5, allow_fused=fused)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(prefix_causal_attention(q, k, v, prefixes=one, q_start=14, scale=0.5), q, dout)
    gb = torch.autograd.grad(prefix_causal_attention(q, k, v, prefixes=two, q_start=14, scale=0.5), q, dout)
    torch.testing.assert_close(ga[0], gb[0], rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("window,prefixes", [(None, 2), (4, 2), (None, 0)])
def test_sinks_join_the_denominator_once_and_get_their_gradient(window, prefixes):
    """gpt-oss's sinks against the naive twin (one extra no-value column per query):
    output and the gradients of q, k, v and the sinks, with the prefix split into two
    segments (merged once over all of them, not once per segment) and blocks of 3."""
    q, k, v, pk, pv, dout = _inputs(4, 2, 5, 13, 8, 8)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()
    cut, q_start = 6, 13
    segs = [KVSegment(pk[:, :cut], pv[:, :cut], 0), KVSegment(pk[:, cut:], pv[:, cut:], cut)][:prefixes]
    out = prefix_causal_attention(q, k, v, prefixes=segs, q_start=q_start, scale=0.37, window=window, block_size=3,
                                  sinks=sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    k_all, v_all = (torch.cat([pk, k], 1), torch.cat([pv, v], 1)) if prefixes else (k, v)
    q_pos = torch.arange(q_start, q_start + 5)
    k_pos = torch.cat([torch.arange(0, 13), q_pos]) if prefixes else q_pos
    ref = naive_attention(q, k_all, v_all, q_pos, k_pos, 0.37, window, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v, sinks), dout)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    assert grads[3].abs().min() > 0
