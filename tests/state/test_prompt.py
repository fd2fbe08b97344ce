"""State classes: sizes, sharding arithmetic, and each kind's gradient accumulation
against plain autograd (exact mode sums dLoss/dState over every reader)."""

import pytest
import torch

from longstraw.models.gated_deltanet import initial_snapshot
from longstraw.ops.attention import prefix_causal_attention
from longstraw.ops.naive import naive_attention
from longstraw.state.prompt import AttentionKV, LatentKV, PromptState, RecurrentState, Shard


def test_recurrent_state_gradient_sums_over_readers():
    g = torch.Generator().manual_seed(0)
    rec, tail = torch.randn(3, 4, 5, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g,
                                                                                      dtype=torch.float64)
    layer = RecurrentState.empty(start=0, keep_all=True)
    layer.put(7, rec, tail)
    layer.enable_grad_buffers()
    state = PromptState(layers=[layer])
    weights = [(torch.randn(3, 4, 5, generator=g, dtype=torch.float64),
                torch.randn(6, 3, generator=g, dtype=torch.float64)) for _ in range(2)]
    for w_rec, w_tail in weights:  # two branches read the same snapshot
        r, t = initial_snapshot([state], 0, 7)
        ((r * w_rec).sum() + (t.sin() * w_tail).sum()).backward()
    want_rec = sum(w for w, _ in weights)
    want_tail = sum(w * tail.cos() for _, w in weights)
    torch.testing.assert_close(layer.grads[7][0], want_rec)
    torch.testing.assert_close(layer.grads[7][1], want_tail)
    assert not rec.requires_grad  # the snapshot itself is never part of a graph


def test_latent_state_key_and_value_gradients_share_one_buffer():
    """Absorbed MLA reads a latent row as key [R + Dr] and its first R columns as value;
    exact mode's sink must hold dk + dv (on the first R columns) in one buffer."""
    g = torch.Generator().manual_seed(1)
    rank, rope, s = 6, 2, 9
    kv = LatentKV.empty_latent(rank=rank, rope_dim=rope, capacity=s, dtype=torch.float64, device="cpu")
    rows = torch.randn(1, s, rank + rope, generator=g, dtype=torch.float64)
    kv.append(rows, rows[..., :rank])
    kv.enable_grad_buffers()
    assert kv.v_grad.data_ptr() == kv.k_grad.data_ptr() and kv.nbytes() == rows.numel() * 8
    q = torch.randn(3, 4, rank + rope, generator=g, dtype=torch.float64, requires_grad=True)
    k_new = torch.randn(1, 4, rank + rope, generator=g, dtype=torch.float64)
    dout = torch.randn(3, 4, rank, generator=g, dtype=torch.float64)
    out = prefix_causal_attention(q, k_new, k_new[..., :rank], prefixes=[kv.segment()], q_start=s, scale=0.5,
                                  block_size=4)
    (out * dout).sum().backward()
    leaf = rows.clone().requires_grad_()
    keys = torch.cat([leaf[0], k_new[0]])
    ref = naive_attention(q, keys[None], keys[None, :, :rank], torch.arange(s, s + 4), torch.arange(s + 4), 0.5)
    (want,) = torch.autograd.grad((ref * dout).sum(), leaf)
    torch.testing.assert_close(kv.k_grad, want, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("world,block", [(2, 3), (3, 1), (3, 4)])
def test_shard_arithmetic_matches_brute_force(world, block):
    for rank in range(world):
        shard = Shard(rank=rank, world=world, block=block)
        owned = [p for p in range(50) if (p // block) % world == rank]
        assert [shard.count(n) for n in range(51)] == [sum(p < n for p in owned) for n in range(51)]
        assert shard.owned(5, 40).nonzero()[:, 0].add(5).tolist() == [p for p in owned if 5 <= p < 40]
        positions = torch.arange(50)
        assert shard.count(positions).tolist() == [shard.count(n) for n in range(50)]


def test_sharded_attention_state_holds_its_rows_and_seeds_the_rest_with_zeros():
    shard = Shard(rank=1, world=2, block=2)
    kv = AttentionKV.empty(kv_heads=1, head_dim=3, v_head_dim=3, capacity=10, window=None, dtype=torch.float64,
                           device="cpu", shard=shard)
    full = torch.arange(30, dtype=torch.float64).view(1, 10, 3)
    kv.append(full[:, :7], full[:, :7])
    kv.append(full[:, 7:], full[:, 7:])
    mine = [2, 3, 6, 7]
    assert torch.equal(kv.keys()[0], full[:, mine]) and kv.end == 10
    assert torch.equal(kv.keys(until=7)[0], full[:, [2, 3, 6]])
    kv.enable_grad_buffers()
    kv.k_grad += 1
    dk, _ = kv.chunk_grads(4, 8)  # positions 4..7: ours are 6 and 7
    assert dk[0, :, 0].tolist() == [0, 0, 1, 1]


def test_gradient_buffers_accumulate_in_float32_for_half_states():
    from longstraw.state.prompt import AttentionKV, LatentKV, RecurrentState

    kv = AttentionKV.empty(kv_heads=1, head_dim=4, v_head_dim=4, capacity=3, window=None, dtype=torch.bfloat16,
                           device="cpu")
    kv.append(torch.ones(1, 3, 4, dtype=torch.bfloat16), torch.ones(1, 3, 4, dtype=torch.bfloat16))
    kv.enable_grad_buffers()
    latent = LatentKV.empty_latent(rank=3, rope_dim=2, capacity=2, dtype=torch.float16, device="cpu")
    latent.append(torch.ones(1, 2, 5, dtype=torch.float16), torch.ones(1, 2, 3, dtype=torch.float16))
    latent.enable_grad_buffers()
    assert kv.k_grad.dtype == kv.v_grad.dtype == latent.k_grad.dtype == torch.float32
    rec = RecurrentState.empty(start=0, keep_all=True)
    rec.enable_grad_buffers()
    for _ in range(300):  # 300 equal terms: a bf16 sum stalls at 256
        rec.add_grad(4, 1, torch.ones(2, 3, dtype=torch.bfloat16))
    assert rec.grads[4][1].dtype == torch.float32 and float(rec.grads[4][1][0, 0]) == 300


def test_offloaded_snapshots_keep_the_latest_on_the_device():
    """`host`: put moves the previous latest snapshot to host memory, `get` stages one back
    (counted once, reused for a recompute's second read), and the latest stays put."""
    g = torch.Generator().manual_seed(2)
    pairs = [(torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g,
                                                                                dtype=torch.float64))
             for _ in range(3)]
    layer = RecurrentState.empty(start=0, keep_all=True)
    layer.host = True
    for p, (rec, tail) in zip((4, 8, 10), pairs):
        layer.put(p, rec, tail)
    one = sum(t.numel() * t.element_size() for t in pairs[0])
    assert layer.on_host == {4, 8} and layer.d2h_bytes == 2 * one and layer.h2d_bytes == 0
    assert layer.get(10, "cpu")[0].data_ptr() == pairs[2][0].data_ptr()  # the latest: held where it was made
    staged = layer.get(4, "cpu")
    torch.testing.assert_close(staged[0], pairs[0][0], rtol=0, atol=0)
    assert layer.get(4, "cpu") is staged and layer.h2d_bytes == one  # a second read stages nothing
    layer.get(8, "cpu")
    assert layer.h2d_bytes == 2 * one and layer.staged[0] == 8


def test_take_grad_removes_it():
    layer = RecurrentState.empty(start=0, keep_all=True)
    layer.enable_grad_buffers()
    layer.add_grad(6, 0, torch.ones(2, 2, 2))
    rec, tail = layer.take_grad(6)
    assert float(rec.sum()) == 8 and tail is None and layer.grads == {}
    assert layer.take_grad(6) == (None, None)
