"""DSA (indexer top-k + sparse latent attention) against the dense naive twins, in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.ops.attention import KVSegment, prefix_causal_attention
from longstraw.ops import dsa, sparse_latent
from longstraw.ops.dsa import indexer_topk, sparse_latent_attention
from longstraw.ops.naive import naive_indexer_scores, naive_indexer_topk, naive_sparse_attention

HI, DI = 3, 8  # indexer heads / dim
D, DV = 10, 6  # latent key dim (kv_lora_rank + rope) / value dim (kv_lora_rank)


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g, (lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64))


def _layout(seg_lens, first=2, gap=1):
    """Segment starts with `gap` unused positions between segments; returns (starts, q_start)."""
    starts, pos = [], first
    for s in seg_lens:
        starts.append(pos)
        pos += s + gap
    return starts, pos


def _positions(seg_lens, starts, q_start, t):
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, seg_lens)] + [torch.arange(q_start, q_start + t)])


def _indexer_inputs(t, seg_lens, seed=0):
    _, mk = _gen(seed)
    starts, q_start = _layout(seg_lens)
    q_idx, weights = mk(t, HI, DI), mk(t, HI)  # weights of both signs, as weights_proj gives
    seg_keys = [mk(n, DI) for n in seg_lens]
    new_keys = mk(t, DI)
    return q_idx, weights, list(zip(seg_keys, starts)), new_keys, q_start


def _naive_topk(q_idx, weights, segments, new_keys, q_start, topk, scale):
    t = q_idx.shape[0]
    keys_all = torch.cat([k for k, _ in segments] + [new_keys])
    pos_all = torch.cat([torch.arange(s, s + k.shape[0]) for k, s in segments] + [torch.arange(q_start, q_start + t)])
    return naive_indexer_topk(q_idx, weights, keys_all, pos_all, torch.arange(q_start, q_start + t), topk, scale)


# ----------------------------------------------------------------------------------------------- indexer


@pytest.mark.parametrize(
    "t,seg_lens,topk,block",
    [(5, [7], 4, 128), (5, [7], 30, 2), (9, [4, 0, 6], 6, 4), (9, [4, 6], 13, 1), (1, [], 3, 128),
     (6, [], 2, 4), (12, [3, 5, 2], 12, 5), (4, [20], 1, 3)],
)
def test_indexer_matches_naive(t, seg_lens, topk, block):
    q_idx, weights, segments, new_keys, q_start = _indexer_inputs(t, seg_lens)
    got = indexer_topk(q_idx, weights, segments, new_keys, q_start, topk, scale=0.3, query_block=block, key_block=4)
    want = _naive_topk(q_idx, weights, segments, new_keys, q_start, topk, 0.3)
    assert got.dtype == torch.long and got.shape == (t, topk)
    assert torch.equal(got, want)
    # a query always sees itself; -1 only as trailing padding, exactly when fewer than topk are visible
    visible = sum(seg_lens) + torch.arange(1, t + 1)
    assert torch.equal((got >= 0).sum(1), visible.clamp(max=topk))


def test_indexer_scores_are_hf_formula_and_topk_sets_agree():
    """naive_indexer_scores is HF's GlmMoeDsaIndexer arithmetic; the selected sets equal torch.topk's
    (no ties in random data) over the visible positions."""
    t, s, topk, scale = 6, 9, 5, DI ** -0.5
    q_idx, weights, segments, new_keys, q_start = _indexer_inputs(t, [s], seed=3)
    k = torch.cat([segments[0][0], new_keys])  # [N, Di]
    # HF: scores = relu(matmul(q, k^T) * softmax_scale); index = matmul(weights.unsqueeze(-2), scores)
    hf = F.relu(torch.matmul(q_idx.transpose(0, 1), k.T.unsqueeze(0)) * scale)  # [Hi, T, N]
    hf = torch.matmul(weights.unsqueeze(-2), hf.transpose(0, 1)).squeeze(-2)  # [T, N]
    k_pos = torch.cat([torch.arange(segments[0][1], segments[0][1] + s), torch.arange(q_start, q_start + t)])
    q_pos = torch.arange(q_start, q_start + t)
    hf = hf.masked_fill(k_pos[None] > q_pos[:, None], float("-inf"))
    naive = naive_indexer_scores(q_idx, weights, k, k_pos, q_pos, scale)
    torch.testing.assert_close(naive, hf, rtol=1e-13, atol=1e-13)
    got = indexer_topk(q_idx, weights, segments, new_keys, q_start, topk, scale=scale)
    got_scores = naive.gather(1, torch.searchsorted(k_pos, got))
    assert (got_scores.diff(dim=1) <= 0).all()  # best first
    # relu makes exact ties (often at 0), where HF picks arbitrarily: compare the selected scores
    torch.testing.assert_close(got_scores, hf.topk(topk, dim=-1).values, rtol=1e-13, atol=1e-13)


def test_indexer_invariant_to_segment_split_query_block_and_chunking():
    t, topk = 11, 7
    q_idx, weights, segments, new_keys, q_start = _indexer_inputs(t, [14], seed=5)
    (keys, start), = segments
    ref = indexer_topk(q_idx, weights, segments, new_keys, q_start, topk, scale=0.5)
    pieces = [(keys[:3], start), (keys[3:4], start + 3), (keys[4:], start + 4)]
    for segs in (pieces, pieces[::-1]):
        for block in (1, 3, 11, 128):
            got = indexer_topk(q_idx, weights, segs, new_keys, q_start, topk, scale=0.5, query_block=block)
            assert torch.equal(got, ref)
    # a prompt captured in chunks: the first chunk's keys become a segment for the second
    for a in (1, 4, 10):
        first = indexer_topk(q_idx[:a], weights[:a], segments, new_keys[:a], q_start, topk, scale=0.5)
        second = indexer_topk(q_idx[a:], weights[a:], segments + [(new_keys[:a], q_start)], new_keys[a:],
                              q_start + a, topk, scale=0.5)
        assert torch.equal(torch.cat([first, second]), ref)


def test_ties_from_duplicate_keys_go_to_lower_positions():
    """Integer data, so every score is exact whatever the summation order."""
    g = torch.Generator().manual_seed(7)
    ints = lambda *s: torch.randint(-3, 4, s, generator=g).to(torch.float64)  # noqa: E731
    t, s = 6, 12
    keys = ints(s, DI)
    new_keys = ints(t, DI)
    keys[5] = keys[1]  # same scores as position 1
    keys[9] = keys[1]
    new_keys[2] = keys[1]
    new_keys[0] = keys[4]
    q_idx, weights = ints(t, HI, DI), torch.rand(t, HI, generator=g, dtype=torch.float64).round(decimals=1) + 0.5
    weights[:, 0] = -0.5  # signed weights, still exact (multiples of 1/2 and 1/10 only in the last head)
    weights = torch.round(weights * 4) / 4  # dyadic -> exact sums
    q_start = s + 4
    all_pos = torch.cat([torch.arange(0, s), torch.arange(q_start, q_start + t)])
    all_keys = torch.cat([keys, new_keys])
    q_pos = torch.arange(q_start, q_start + t)
    scores = naive_indexer_scores(q_idx, weights, all_keys, all_pos, q_pos, 0.5)
    seen_boundary_tie = False
    for topk in range(1, s + t + 2):
        want = naive_indexer_topk(q_idx, weights, all_keys, all_pos, q_pos, topk, 0.5)
        for segs in ([(keys, 0)], [(keys[:6], 0), (keys[6:], 6)]):
            for block in (1, 4):
                got = indexer_topk(q_idx, weights, segs, new_keys, q_start, topk, scale=0.5, query_block=block)
                assert torch.equal(got, want), (topk, block)
        # explicit check of the rule: within equal scores, positions increase along the row
        sel = torch.searchsorted(all_pos, want.clamp(min=0))
        sc = scores.gather(1, sel)
        same = (sc[:, 1:] == sc[:, :-1]) & (want[:, 1:] >= 0)
        assert (want[:, 1:][same] > want[:, :-1][same]).all()
        # the tie at the cut: a left-out position never ties a selected one at a lower position
        for r in range(t):
            picked = set(want[r].tolist()) - {-1}
            last = sc[r, len(picked) - 1]
            for n, p in enumerate(all_pos.tolist()):
                if p not in picked and p <= q_start + r and scores[r, n] == last:
                    seen_boundary_tie = True
                    assert p > max(q for q in picked if scores[r, all_pos.tolist().index(q)] == last)
    assert seen_boundary_tie


def test_all_zero_scores_from_relu_pick_the_lowest_positions():
    t, s, topk = 5, 6, 4
    keys, new_keys = torch.rand(s, DI, dtype=torch.float64) + 0.1, torch.rand(t, DI, dtype=torch.float64) + 0.1
    q_idx = -torch.rand(t, HI, DI, dtype=torch.float64) - 0.1  # every dot product < 0 -> relu -> 0
    q_idx[3, 1] = 1.0  # except query 3, which prefers its own newest keys by key norm
    weights = torch.rand(t, HI, dtype=torch.float64) + 0.5
    segs = [(keys[:2], 10), (keys[2:], 20)]  # positions 10, 11, 20..23
    q_start = 30
    got = indexer_topk(q_idx, weights, segs, new_keys, q_start, topk, scale=1.0, query_block=2)
    assert got[0].tolist() == [10, 11, 20, 21]
    assert got[4].tolist() == [10, 11, 20, 21]
    want = _naive_topk(q_idx, weights, segs, new_keys, q_start, topk, 1.0)
    assert torch.equal(got, want)
    # all zeros and topk beyond what is visible: every visible position, in position order, then -1
    got = indexer_topk(q_idx[:1], weights[:1], segs, new_keys[:1], q_start, 9, scale=1.0)
    assert got[0].tolist() == [10, 11, 20, 21, 22, 23, 30, -1, -1]


# ----------------------------------------------------------------------------------------------- attention


def _random_indices(t, seg_lens, starts, q_start, k, g, pad=True):
    """Random distinct visible positions per query, in random order, some -1 (never a whole row)."""
    prefix = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, seg_lens)] + [torch.zeros(0, dtype=torch.long)])
    rows = []
    for i in range(t):
        vis = torch.cat([prefix, torch.arange(q_start, q_start + i + 1)])
        n = min(k, vis.numel())
        if pad:
            n = int(torch.randint(1, n + 1, (1,), generator=g))
        pick = vis[torch.randperm(vis.numel(), generator=g)[:n]].tolist()
        pick += [-1] * (k - n)
        rows.append([pick[j] for j in torch.randperm(k, generator=g).tolist()])
    return torch.tensor(rows, dtype=torch.long)


def _attn_case(h, t, seg_lens, k, seed=0, latent_view=False, sink="separate", pad=True):
    """Inputs, leaves and the naive reference. latent_view: v is the first DV columns of k (state and
    new tokens), as absorbed MLA stores it. sink: None | 'separate' | 'view' (dv a view into dk)."""
    g, mk = _gen(seed)
    starts, q_start = _layout(seg_lens)
    q = mk(h, t, D).requires_grad_()
    kn = mk(t, D).requires_grad_()
    vn = kn[:, :DV] if latent_view else mk(t, DV).requires_grad_()
    leaves = (q, kn) if latent_view else (q, kn, vn)
    segs, naive_k, naive_v = [], [], []
    for n, s in zip(seg_lens, starts):
        pk = mk(1, n, D)
        pv = pk[..., :DV] if latent_view else mk(1, n, DV)
        buf = None
        if sink == "separate":
            buf = (torch.zeros(1, n, D, dtype=torch.float64), torch.zeros(1, n, DV, dtype=torch.float64))
        elif sink == "view":
            dk = torch.zeros(1, n, D, dtype=torch.float64)
            buf = (dk, dk[..., :DV])
        segs.append(KVSegment(pk, pv, s, buf))
        naive_k.append(pk[0].clone().requires_grad_())
        naive_v.append(pv[0].clone().requires_grad_())
    indices = _random_indices(t, seg_lens, starts, q_start, k, g, pad=pad)
    ref = naive_sparse_attention(q, torch.cat(naive_k + [kn]), torch.cat(naive_v + [vn]),
                                 _positions(seg_lens, starts, q_start, t), indices,
                                 torch.arange(q_start, q_start + t), 0.37)
    return dict(q=q, kn=kn, vn=vn, leaves=leaves, segs=segs, naive_k=naive_k, naive_v=naive_v, indices=indices,
                q_start=q_start, ref=ref, dout=mk(h, t, DV))


@pytest.mark.parametrize(
    "h,t,seg_lens,k,block,latent_view,sink",
    [(2, 5, [9], 4, 2, False, "separate"), (3, 7, [4, 6], 6, 3, False, "view"), (2, 6, [5, 0, 8], 5, 4, True, "view"),
     (1, 4, [], 3, 1, False, None), (4, 9, [12], 20, 64, True, "separate"), (2, 8, [3, 3, 3], 2, 5, False, "view")],
)
def test_sparse_attention_matches_naive_output_grads_and_sinks(h, t, seg_lens, k, block, latent_view, sink):
    c = _attn_case(h, t, seg_lens, k, latent_view=latent_view, sink=sink)
    out = sparse_latent_attention(c["q"], c["kn"], c["vn"], c["indices"], prefixes=c["segs"], q_start=c["q_start"],
                                  scale=0.37, query_block=block)
    assert out.shape == (h, t, DV) and out.dtype == torch.float64
    torch.testing.assert_close(out, c["ref"], rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, c["leaves"], c["dout"])
    want = torch.autograd.grad(c["ref"], c["leaves"] + tuple(c["naive_k"] + c["naive_v"]), c["dout"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    n_seg = len(seg_lens)
    gk, gv = want[len(got):len(got) + n_seg], want[len(got) + n_seg:]
    for seg, dk, dv in zip(c["segs"], gk, gv):
        assert not seg.k.requires_grad and seg.k.grad is None
        if sink == "separate":
            torch.testing.assert_close(seg.grad[0][0], dk, rtol=1e-11, atol=1e-11)
            torch.testing.assert_close(seg.grad[1][0], dv, rtol=1e-11, atol=1e-11)
        elif sink == "view":  # one buffer holds dk + dv on its first DV columns
            torch.testing.assert_close(seg.grad[0][0], dk + F.pad(dv, (0, D - DV)), rtol=1e-11, atol=1e-11)


def test_sinks_accumulate_over_calls_and_indices_order_is_irrelevant():
    c1 = _attn_case(2, 5, [7], 4, seed=1, sink="view")
    c2 = _attn_case(2, 5, [7], 4, seed=1, sink="view")
    kw = dict(prefixes=c1["segs"], q_start=c1["q_start"], scale=0.37, query_block=2)
    for idx in (c1["indices"], c1["indices"].flip(1)):
        out = sparse_latent_attention(c1["q"], c1["kn"], c1["vn"], idx, **kw)
        torch.testing.assert_close(out, c1["ref"], rtol=1e-12, atol=1e-12)
        (out * c1["dout"]).sum().backward()
    out = sparse_latent_attention(c2["q"], c2["kn"], c2["vn"], c2["indices"], **{**kw, "prefixes": c2["segs"]})
    (out * c2["dout"]).sum().backward()
    torch.testing.assert_close(c1["segs"][0].grad[0], 2 * c2["segs"][0].grad[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c1["q"].grad, 2 * c2["q"].grad, rtol=1e-12, atol=1e-12)


def test_row_without_indices_gives_zeros_and_finite_grads():
    c = _attn_case(2, 3, [4], 3, seed=2)
    idx = c["indices"].clone()
    idx[1] = -1
    out = sparse_latent_attention(c["q"], c["kn"], c["vn"], idx, prefixes=c["segs"], q_start=c["q_start"], scale=0.37)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    grads = torch.autograd.grad(out, c["leaves"], c["dout"])
    assert all(torch.isfinite(x).all() for x in grads)
    assert torch.equal(grads[0][:, 1], torch.zeros_like(grads[0][:, 1]))


def test_bad_index_raises():
    c = _attn_case(1, 2, [4], 2, seed=3)
    idx = c["indices"].clone()
    idx[0, 0] = c["segs"][0].start + 4  # the gap after the segment: no such position
    with pytest.raises(RuntimeError, match="visible position"):
        sparse_latent_attention(c["q"], c["kn"], c["vn"], idx, prefixes=c["segs"], q_start=c["q_start"], scale=0.37)


@pytest.mark.parametrize("latent_view", [False, True])
def test_topk_covering_everything_equals_dense_prefix_causal_attention(latent_view):
    """With topk >= every visible position DSA is dense MLA: the engine's dense op, grads and sinks included."""
    h, t, seg_lens = 3, 6, [5, 7]
    c = _attn_case(h, t, seg_lens, 1, seed=4, latent_view=latent_view, sink="view")
    starts, q_start = _layout(seg_lens)
    q_idx, weights, _, new_keys, _ = _indexer_inputs(t, [])
    keysets = [(torch.randn(n, DI, dtype=torch.float64), s) for n, s in zip(seg_lens, starts)]
    idx = indexer_topk(q_idx, weights, keysets, new_keys, q_start, sum(seg_lens) + t + 3, scale=0.3, query_block=4)
    out = sparse_latent_attention(c["q"], c["kn"], c["vn"], idx, prefixes=c["segs"], q_start=q_start, scale=0.37,
                                  query_block=4)
    got = torch.autograd.grad(out, c["leaves"], c["dout"])
    sinks = [seg.grad[0].clone() for seg in c["segs"]]
    dense_segs = [KVSegment(s.k, s.v, s.start, (torch.zeros_like(s.k), torch.zeros_like(s.v))) for s in c["segs"]]
    ref = prefix_causal_attention(c["q"], c["kn"][None], c["vn"][None], prefixes=dense_segs, q_start=q_start,
                                  scale=0.37, block_size=3, allow_fused=False)
    want = torch.autograd.grad(ref, c["leaves"], c["dout"])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    for sink, seg in zip(sinks, dense_segs):
        torch.testing.assert_close(sink, seg.grad[0] + F.pad(seg.grad[1], (0, D - DV)), rtol=1e-11, atol=1e-11)


# ----------------------------------------------------------------------------------------------- memory guard


class _Allocations(TorchDispatchMode):
    """Records the numel of every tensor an op creates (outputs not sharing storage with an input:
    views and in-place results are not allocations), and the op names seen."""

    def __init__(self):
        super().__init__()
        self.sizes, self.ops = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        ptrs = {x.untyped_storage().data_ptr() for x in inputs}
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in ptrs:
                self.sizes.append(x.numel())
        self.ops.add(func.overloadpacket.__name__)
        return out


def _plain_loops(monkeypatch):
    """Run sparse attention through the registered ops' plain loops, so a mode sees the ops inside."""
    monkeypatch.setattr(dsa, "sparse_latent_forward", sparse_latent.forward_blocks)
    monkeypatch.setattr(dsa, "sparse_latent_backward", sparse_latent.backward_blocks)


def test_sparse_attention_never_allocates_state_sized_tensors(monkeypatch):
    h, t, s, k = 2, 6, 5000, 5
    c = _attn_case(h, t, [s], k, seed=6, latent_view=True, sink="view", pad=False)
    _plain_loops(monkeypatch)
    mode = _Allocations()
    with mode:
        out = sparse_latent_attention(c["q"], c["kn"], c["vn"], c["indices"], prefixes=c["segs"],
                                      q_start=c["q_start"], scale=0.37, query_block=4)
        out.backward(c["dout"])
    assert "index_add_" in mode.ops  # the backward ran under the mode
    # nothing scales with S: the largest are gathered rows [block, K, D] and the plan's dummy
    # row (T*S = 30000, S*D = 50000)
    assert max(mode.sizes) <= max(h * t * D, (4 * k + 1) * D)
    torch.testing.assert_close(out, c["ref"], rtol=1e-12, atol=1e-12)


def test_indexer_memory_is_query_block_by_positions():
    t, s, block = 40, 3000, 8
    q_idx, weights, segments, new_keys, q_start = _indexer_inputs(t, [s], seed=8)
    mode = _Allocations()
    with mode:
        got = indexer_topk(q_idx, weights, segments, new_keys, q_start, 16, scale=0.3, query_block=block,
                           key_block=512)
    assert max(mode.sizes) <= block * (s + t)  # O(query_block x N), far below T x S = 120000
    want = indexer_topk(q_idx, weights, segments, new_keys, q_start, 16, scale=0.3, query_block=t)
    assert torch.equal(got, want)


def test_float32_inputs_accumulate_in_float32_and_agree_with_float64():
    c = _attn_case(2, 6, [9], 5, seed=9, latent_view=True, sink="view")
    f32 = lambda x: x.detach().float()  # noqa: E731
    q, kn = f32(c["q"]).requires_grad_(), f32(c["kn"]).requires_grad_()
    sink = torch.zeros(1, 9, D)
    seg = c["segs"][0]
    segs = [KVSegment(f32(seg.k), f32(seg.k)[..., :DV], seg.start, (sink, sink[..., :DV]))]
    out = sparse_latent_attention(q, kn, kn[:, :DV], c["indices"], prefixes=segs, q_start=c["q_start"], scale=0.37,
                                  query_block=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), c["ref"], rtol=1e-5, atol=1e-5)
    (out * c["dout"].float()).sum().backward()
    want = torch.autograd.grad(c["ref"], (c["q"], c["kn"], c["naive_k"][0], c["naive_v"][0]), c["dout"])
    torch.testing.assert_close(q.grad.double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kn.grad.double(), want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sink[0].double(), want[2] + F.pad(want[3], (0, D - DV)), rtol=1e-5, atol=1e-5)
    q_idx, weights, segments, new_keys, q_start = _indexer_inputs(7, [10], seed=9)
    got = indexer_topk(q_idx.float(), weights.float(), [(k.float(), s) for k, s in segments], new_keys.float(),
                       q_start, 6, scale=0.3, query_block=3)
    assert torch.equal(got, indexer_topk(q_idx, weights, segments, new_keys, q_start, 6, scale=0.3))


def test_sparse_attention_never_reads_device_data(monkeypatch):
    """Where each block's entries live is planned from host-known bounds (`ops/dsa_plan.py`):
    no read of device data in forward or backward, however many query blocks (before: one read
    of the block counts per call, i.e. per layer and chunk on a GPU)."""
    c = _attn_case(2, 12, [9, 7], 5, seed=9, sink="separate")
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or tolist(self))
    _plain_loops(monkeypatch)
    mode = _Allocations()
    with mode:
        out = sparse_latent_attention(c["q"], c["kn"], c["vn"], c["indices"], prefixes=c["segs"],
                                      q_start=c["q_start"], scale=0.37, query_block=2)  # 6 query blocks
        out.backward(c["dout"])
    assert "index_add_" in mode.ops  # the backward ran under the mode
    assert reads == []
    # no op whose output size or result the host must wait for, per block
    assert not {"nonzero", "equal", "_local_scalar_dense", "item"} & mode.ops, mode.ops
    torch.testing.assert_close(out, c["ref"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("topk,n", [(5, 40), (8, 8), (12, 7), (1, 30)])
def test_select_candidates_equals_sorting_every_candidate(topk, n, dtype):
    """The selection (float32: one top-k over (score, position) keys; float64: the threshold,
    the lowest tied positions, then sorting topk columns) equals sorting all n candidates:
    scores drawn from a few values (many ties, zeros of both signs, and ties at the cut),
    empty slots (-1), rows with fewer finite candidates than topk, and distinct positions per
    row in random order."""
    from longstraw.ops.dsa import select_candidates
    from longstraw.ops.naive import naive_select_candidates

    g = torch.Generator().manual_seed(topk * 100 + n)
    rows = 64
    scores = torch.randint(0, 4, (rows, n), generator=g).to(torch.float64) * 0.5
    scores[rows // 2:] += torch.rand(rows - rows // 2, n, generator=g, dtype=torch.float64) * 1e-3 * (
        torch.rand(rows - rows // 2, n, generator=g) < 0.5)
    positions = torch.stack([torch.randperm(1000, generator=g)[:n] for _ in range(rows)])
    empty = torch.rand(rows, n, generator=g) < 0.3
    empty[:4] = torch.rand(4, n, generator=g) < 0.9  # rows with fewer candidates than topk
    positions = torch.where(empty, torch.full_like(positions, -1), positions)
    scores[5, :] = float("-inf")  # a row with nothing visible
    scores[6:10] = torch.where(torch.rand(4, n, generator=g) < 0.5, -scores[6:10], scores[6:10]).clamp(max=0)  # +-0.0
    assert (torch.signbit(scores[6:10]) & (scores[6:10] == 0)).any()
    scores = scores.to(dtype)
    got_pos, got_sc = select_candidates(scores, positions, topk, with_scores=True)
    want_pos, want_sc = naive_select_candidates(scores, positions, topk)
    assert torch.equal(got_pos, want_pos)
    assert torch.equal(got_sc, want_sc)
    assert torch.equal(select_candidates(scores, positions, topk), want_pos)


class _Ops(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_selections_never_read_device_data(dtype):
    """`select_topk` and `select_candidates` run no op whose output size or value the host
    must wait for (on a GPU a sync per query block; on a rehearsal's fake tensors an error),
    and give the sorting twin's selection."""
    from longstraw.ops.dsa import select_candidates, select_topk
    from longstraw.ops.naive import naive_select_candidates

    g = torch.Generator().manual_seed(3)
    scores = (torch.randint(0, 3, (16, 20), generator=g) * 0.5).to(dtype)
    scores[:, 15:] = float("-inf")
    scores[2] = float("-inf")
    pos = torch.arange(100, 120)
    with _Ops() as mode:
        top = select_topk(scores, pos, 7)
        cand = select_candidates(scores, pos.expand(16, 20), 7)
    assert not {"nonzero", "equal", "_local_scalar_dense", "item", "masked_select"} & mode.ops, mode.ops
    want = naive_select_candidates(scores, pos.expand(16, 20).clone(), 7)[0]
    assert torch.equal(top, want) and torch.equal(cand, want)
    assert top[2].tolist() == [-1] * 7 and top[0, 0] >= 100
