"""Batched one-token (decode) ops against their naive twins, float64: attention over a
shared prefix + each branch's own tokens, the gathered (DSA) partial, the recurrent
gated-delta step and the conv step."""

import pytest
import torch

from longstraw.ops import flash
from longstraw.ops.attention import KVSegment, merge_partials
from longstraw.ops.causal_conv import causal_conv1d_step
from longstraw.ops.decode_attention import decode_attention, gathered_partial
from longstraw.ops.gated_delta import gated_delta_step
from longstraw.ops.naive import naive_attention, naive_causal_conv1d, naive_gated_delta_rule


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("g_branches,h,hkv,s,n,d,dv,window,block", [
    (3, 4, 2, 13, 5, 8, 8, None, 4),   # GQA, block not dividing S
    (1, 2, 2, 7, 1, 6, 6, None, 16),   # one branch, first token, block > S
    (4, 4, 1, 11, 3, 8, 5, None, 3),   # MQA with Dv < D (absorbed MLA shape)
    (2, 4, 2, 12, 6, 8, 8, 5, 4),      # sliding window hides part of the prefix and of the own tokens
    (2, 4, 2, 3, 9, 8, 8, 4, 2),       # window entirely inside the own tokens
])
def test_decode_attention_matches_naive_per_branch(monkeypatch, fused, g_branches, h, hkv, s, n, d, dv, window,
                                                    block):
    monkeypatch.setattr(flash, "FUSED_ENABLED", fused)
    gen = torch.Generator().manual_seed(0)
    q = _randn(gen, g_branches, h, d)
    pk, pv = _randn(gen, hkv, s, d), _randn(gen, hkv, s, dv)
    own_k, own_v = _randn(gen, g_branches, hkv, n, d), _randn(gen, g_branches, hkv, n, dv)
    p_start, own_start = 2, 2 + s  # the prefix is not at position 0; the branch follows it
    position = own_start + n - 1
    scale = d ** -0.5
    # the prefix split in two segments, as a state of earlier pieces would be
    cut = s // 2
    segs = [KVSegment(pk[:, :cut], pv[:, :cut], p_start), KVSegment(pk[:, cut:], pv[:, cut:], p_start + cut)]
    got = decode_attention(q, own_k, own_v, own_start=own_start, prefixes=segs, q_position=position, scale=scale,
                           window=window, block_size=block)
    assert got.shape == (g_branches, h, dv)
    for b in range(g_branches):
        k = torch.cat([pk, own_k[b]], dim=1)
        v = torch.cat([pv, own_v[b]], dim=1)
        k_pos = torch.cat([torch.arange(p_start, p_start + s), torch.arange(own_start, own_start + n)])
        want = naive_attention(q[b][:, None], k, v, torch.tensor([position]), k_pos, scale, window)[:, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [None, 6, 3])
def test_decode_attention_with_per_branch_positions_matches_naive(monkeypatch, fused, window):
    """Branches at their own positions in one call (own_lengths, q_position [G]): each
    equals the naive attention over its own filled rows only; the rows past a shorter
    branch's length hold garbage (NaN) that must never be read."""
    monkeypatch.setattr(flash, "FUSED_ENABLED", fused)
    gen = torch.Generator().manual_seed(2)
    g_branches, h, hkv, s, n, d = 4, 4, 2, 9, 7, 8
    lengths = torch.tensor([7, 1, 4, 6])  # (G,) rows each branch holds
    q = _randn(gen, g_branches, h, d)
    pk, pv = _randn(gen, hkv, s, d), _randn(gen, hkv, s, d)
    own_k, own_v = _randn(gen, g_branches, hkv, n, d), _randn(gen, g_branches, hkv, n, d)
    for b, m in enumerate(lengths.tolist()):
        own_k[b, :, m:], own_v[b, :, m:] = float("nan"), float("nan")
    p_start, own_start, scale = 1, 1 + s, d ** -0.5
    positions = own_start + lengths - 1  # (G,)
    got = decode_attention(q, own_k, own_v, own_start=own_start, prefixes=[KVSegment(pk, pv, p_start)],
                           q_position=positions, scale=scale, window=window, block_size=4, own_lengths=lengths)
    for b, m in enumerate(lengths.tolist()):
        k, v = torch.cat([pk, own_k[b, :, :m]], dim=1), torch.cat([pv, own_v[b, :, :m]], dim=1)
        k_pos = torch.cat([torch.arange(p_start, p_start + s), torch.arange(own_start, own_start + m)])
        want = naive_attention(q[b][:, None], k, v, positions[b:b + 1], k_pos, scale, window)[:, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-12)


def test_decode_attention_reads_the_prefix_in_place():
    """The shared prefix is never written to, and a view of a larger buffer works."""
    gen = torch.Generator().manual_seed(1)
    buf_k, buf_v = _randn(gen, 2, 20, 8), _randn(gen, 2, 20, 8)
    before = buf_k.clone(), buf_v.clone()
    seg = KVSegment(buf_k[:, :9], buf_v[:, :9], 0)
    own_k, own_v = _randn(gen, 3, 2, 2, 8), _randn(gen, 3, 2, 2, 8)
    decode_attention(_randn(gen, 3, 4, 8), own_k, own_v, own_start=9, prefixes=[seg], q_position=10, scale=0.3)
    assert torch.equal(buf_k, before[0]) and torch.equal(buf_v, before[1])


def test_gathered_partial_matches_masked_softmax_and_merges_to_the_union():
    gen = torch.Generator().manual_seed(2)
    g_branches, h, k_sel, d, dv = 3, 4, 6, 8, 5
    q = _randn(gen, g_branches, h, d)
    rows = _randn(gen, g_branches, k_sel, d)
    valid = torch.rand(g_branches, k_sel, generator=gen) > 0.4
    valid[0] = False  # a branch with nothing selected from this source
    valid[1, 0] = valid[2, 1] = True
    out, lse = gathered_partial(q, rows, rows[..., :dv], valid, 0.5)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    for b in (1, 2):
        scores = (q[b] @ rows[b].T * 0.5).masked_fill(~valid[b], float("-inf"))
        torch.testing.assert_close(out[b], torch.softmax(scores, -1) @ rows[b, :, :dv], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    # the merge of two disjoint sources equals attention over their union
    other = _randn(gen, g_branches, 4, d)
    out_b, lse_b = gathered_partial(q, other, other[..., :dv], torch.ones(g_branches, 4, dtype=torch.bool), 0.5)
    merged = merge_partials(out, lse, out_b, lse_b)
    union = torch.cat([rows, other], 1)
    mask = torch.cat([valid, torch.ones(g_branches, 4, dtype=torch.bool)], 1)
    scores = (torch.einsum("bhd,bkd->bhk", q, union) * 0.5).masked_fill(~mask[:, None], float("-inf"))
    torch.testing.assert_close(merged, torch.softmax(scores, -1) @ union[..., :dv], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hk,hv,l2", [(2, 2, True), (1, 3, True), (2, 4, False)])
def test_gated_delta_step_equals_the_naive_rule_token_by_token(hk, hv, l2):
    gen = torch.Generator().manual_seed(3)
    g_branches, steps, dk, dv = 3, 4, 8, 6
    state = _randn(gen, g_branches, hv, dk, dv) * 0.3
    naive_states = list(state)
    for _ in range(steps):
        q, k = _randn(gen, g_branches, hk, dk), _randn(gen, g_branches, hk, dk)
        if not l2:
            k = k * 0.3
        v = _randn(gen, g_branches, hv, dv)
        g = -torch.rand(g_branches, hv, generator=gen, dtype=torch.float64) * 0.6
        beta = torch.rand(g_branches, hv, generator=gen, dtype=torch.float64)
        before = state.clone()
        out, state = gated_delta_step(q, k, v, g, beta, state, use_qk_l2norm=l2)
        for b in range(g_branches):
            want, naive_states[b] = naive_gated_delta_rule(q[b][None], k[b][None], v[b][None], g[b][None],
                                                          beta[b][None], naive_states[b], use_qk_l2norm=l2)
            torch.testing.assert_close(out[b], want[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(state[b], naive_states[b], rtol=1e-12, atol=1e-12)
        assert not torch.equal(before, state)


def test_causal_conv_step_equals_the_naive_conv_token_by_token():
    gen = torch.Generator().manual_seed(4)
    g_branches, c, kw, steps = 3, 5, 4, 6
    weight, bias = _randn(gen, c, kw), _randn(gen, c)
    xs = _randn(gen, g_branches, c, steps)
    tails0 = _randn(gen, g_branches, c, kw - 1)
    tail = tails0
    for j in range(steps):
        y, tail = causal_conv1d_step(xs[:, :, j], weight, bias, tail, activation="silu")
        for b in range(g_branches):
            want, want_tail = naive_causal_conv1d(xs[b, :, : j + 1], weight, bias, tails0[b], activation="silu")
            torch.testing.assert_close(y[b], want[:, j], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(tail[b], want_tail, rtol=1e-12, atol=1e-12)


def test_step_ops_refuse_bad_shapes():
    s = torch.zeros(2, 2, 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="state must be"):
        gated_delta_step(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.zeros(2, 2, 3), torch.zeros(2, 3),
                         torch.zeros(2, 2), s)
    with pytest.raises(ValueError, match="tail must be"):
        causal_conv1d_step(torch.zeros(2, 5), torch.zeros(5, 4), tail=torch.zeros(2, 5, 2))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [None, 4])
def test_decode_attention_with_sinks_matches_naive(monkeypatch, fused, window):
    """gpt-oss's sinks in decode: joined once after the prefix segments and the own
    tokens are merged (the naive twin: one extra no-value column)."""
    monkeypatch.setattr(flash, "FUSED_ENABLED", fused)
    gen = torch.Generator().manual_seed(2)
    b, h, hkv, s, n, d = 3, 4, 2, 9, 3, 8
    q, sinks = _randn(gen, b, h, d), _randn(gen, h)
    pk, pv = _randn(gen, hkv, s, d), _randn(gen, hkv, s, d)
    own_k, own_v = _randn(gen, b, hkv, n, d), _randn(gen, b, hkv, n, d)
    position = s + n - 1
    segs = [KVSegment(pk[:, :4], pv[:, :4], 0), KVSegment(pk[:, 4:], pv[:, 4:], 4)]
    got = decode_attention(q, own_k, own_v, own_start=s, prefixes=segs, q_position=position, scale=0.4,
                           window=window, block_size=2, sinks=sinks)
    for i in range(b):
        k_pos = torch.arange(0, s + n)
        want = naive_attention(q[i][:, None], torch.cat([pk, own_k[i]], 1), torch.cat([pv, own_v[i]], 1),
                               torch.tensor([position]), k_pos, 0.4, window, sinks=sinks)[:, 0]
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
