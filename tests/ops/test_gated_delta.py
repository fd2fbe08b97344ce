"""Chunked gated delta rule against the token-by-token naive twin (float64) and HF's reference."""

import pytest
import torch

from longstraw.ops.gated_delta import chunk_gated_delta_rule, fla_kernel
from longstraw.ops.naive import naive_gated_delta_rule

DK, DV = 8, 6  # different on purpose, so a transposed state cannot pass


def _inputs(t, hk, hv, init=True, seed=0, dtype=torch.float64, device="cpu"):
    """Leaves q, k, v, g, beta, h0 (h0 None when not init) and cotangents for (out, state)."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = mk(t, hk, DK), mk(t, hk, DK), mk(t, hv, DV)
    g = -torch.rand(t, hv, generator=gen, dtype=torch.float64) * 0.6  # log decay in (-0.6, 0]
    beta = torch.rand(t, hv, generator=gen, dtype=torch.float64)
    h0 = mk(hv, DK, DV) * 0.5 if init else None
    dout, dstate = mk(t, hv, DV), mk(hv, DK, DV)
    leaves = [x.to(device=device, dtype=dtype).requires_grad_() if x is not None else None
              for x in (q, k, v, g, beta, h0)]
    return leaves, dout.to(device=device, dtype=dtype), dstate.to(device=device, dtype=dtype)


def _grads(out, state, dout, dstate, leaves):
    wrt = [x for x in leaves if x is not None]
    return torch.autograd.grad((out, state), wrt, (dout, dstate))


@pytest.mark.parametrize(
    "t,chunk,hk,hv,init,l2",
    [(1, 16, 2, 2, False, True), (1, 64, 1, 2, True, True), (5, 16, 2, 4, True, True),
     (64, 16, 2, 2, True, True), (64, 64, 1, 3, False, True), (130, 16, 2, 4, True, True),
     (130, 64, 2, 2, False, True), (37, 16, 1, 2, True, False)],
)
def test_matches_naive_output_state_and_every_input_grad(t, chunk, hk, hv, init, l2):
    leaves, dout, dstate = _inputs(t, hk, hv, init)
    if not l2:  # keep the un-normalised recurrence contractive: |k|^2 * beta < 2
        with torch.no_grad():
            leaves[1].mul_(0.3)
    out, state = chunk_gated_delta_rule(*leaves, chunk_size=chunk, use_qk_l2norm=l2)
    ref, ref_state = naive_gated_delta_rule(*leaves, use_qk_l2norm=l2)
    assert out.shape == (t, hv, DV) and state.shape == (hv, DK, DV)
    assert out.dtype == torch.float64 and state.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)
    got = _grads(out, state, dout, dstate, leaves)
    want = _grads(ref, ref_state, dout, dstate, leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck_small():
    leaves, _, _ = _inputs(5, 1, 2, init=True, seed=3)
    torch.autograd.gradcheck(lambda *xs: chunk_gated_delta_rule(*xs, chunk_size=2), tuple(leaves), fast_mode=True)


@pytest.mark.parametrize("split", [1, 50, 64, 129])
def test_two_calls_with_carried_state_equal_one_call(split):
    """Capture -> replay: the first part's final state is the second part's initial state,
    and gradients flow back through the hand-over."""
    leaves, dout, dstate = _inputs(130, 2, 4, init=True, seed=1)
    q, k, v, g, beta, h0 = leaves
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, h0, chunk_size=16)
    o1, s1 = chunk_gated_delta_rule(q[:split], k[:split], v[:split], g[:split], beta[:split], h0, chunk_size=16)
    o2, s2 = chunk_gated_delta_rule(q[split:], k[split:], v[split:], g[split:], beta[split:], s1, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2]), out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, state, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(torch.cat([o1, o2]), s2, dout, dstate, leaves), _grads(out, state, dout, dstate, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _hf_layout(x):
    return x.detach()[None].contiguous()  # [T, H, ...] -> [1, T, H, ...]


@pytest.mark.parametrize("t,hk,hv,init", [(1, 2, 2, True), (37, 1, 2, True), (130, 2, 4, False)])
def test_matches_hf_torch_chunk_reference(t, hk, hv, init):
    """HF's reference casts q, k, v, g, beta to float32 internally (whatever their dtype)
    and returns the state in float32, so it is compared in float32: against our float32
    path tightly, and against our float64 path at float32 accuracy."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    leaves, _, _ = _inputs(t, hk, hv, init, seed=2, dtype=torch.float32)
    q, k, v, g, beta, h0 = leaves
    hf_out, hf_state = torch_chunk_gated_delta_rule(
        *map(_hf_layout, (q, k, v, g, beta)), chunk_size=64,
        initial_state=None if h0 is None else h0.detach()[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    assert hf_out.dtype == torch.float32 and hf_state.dtype == torch.float32
    with torch.no_grad():
        out, state = chunk_gated_delta_rule(*leaves)
        out64, state64 = chunk_gated_delta_rule(*(x.double() if x is not None else None for x in leaves))
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    torch.testing.assert_close(out, hf_out[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, hf_state[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out64, hf_out[0].double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state64, hf_state[0].double(), rtol=1e-4, atol=1e-4)


def test_naive_matches_hf_recurrent_reference():
    """The twin itself follows HF's token loop (scaling, l2norm, head grouping)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    leaves, _, _ = _inputs(9, 1, 3, True, seed=4, dtype=torch.float32)
    q, k, v, g, beta, h0 = leaves
    hf_out, hf_state = torch_recurrent_gated_delta_rule(
        *map(_hf_layout, (q, k, v, g, beta)), initial_state=h0.detach()[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        out, state = naive_gated_delta_rule(*leaves)
    torch.testing.assert_close(out, hf_out[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, hf_state[0], rtol=1e-5, atol=1e-5)


def test_inputs_untouched_and_initial_state_gets_gradient():
    leaves, dout, dstate = _inputs(40, 2, 4, init=True, seed=5)
    before = [x.detach().clone() for x in leaves]
    out, state = chunk_gated_delta_rule(*leaves, chunk_size=16)
    ((out * dout).sum() + (state * dstate).sum()).backward()
    for x, x0 in zip(leaves, before):
        assert torch.equal(x.detach(), x0)
        assert x.grad is not None and torch.isfinite(x.grad).all()
    assert leaves[5].grad.abs().sum() > 0


def test_float32_inputs_and_float64_initial_state():
    leaves, _, _ = _inputs(20, 2, 2, init=True, seed=6, dtype=torch.float32)
    q, k, v, g, beta, h0 = leaves
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, h0.double(), chunk_size=8)
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    ref, ref_state = naive_gated_delta_rule(*(x.double() for x in leaves))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-4, atol=1e-4)


def test_empty_sequence_returns_the_initial_state():
    leaves, _, _ = _inputs(0, 2, 2, init=True)
    out, state = chunk_gated_delta_rule(*leaves)
    assert out.shape == (0, 2, DV)
    torch.testing.assert_close(state, leaves[5])


def test_bad_head_grouping_is_rejected():
    leaves, _, _ = _inputs(4, 2, 3, init=False)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(*leaves)


@pytest.mark.skipif(not torch.cuda.is_available() or fla_kernel() is None, reason="needs CUDA and fla")
def test_fla_kernel_matches_torch_path():
    leaves, dout, dstate = _inputs(130, 2, 4, init=True, seed=7, dtype=torch.bfloat16, device="cuda")
    h0 = leaves[5].detach().float().requires_grad_()
    leaves = leaves[:5] + [h0]
    out, state = chunk_gated_delta_rule(*leaves)
    ref, ref_state = chunk_gated_delta_rule(*leaves, allow_kernel=False)
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(state, ref_state, rtol=3e-2, atol=3e-2)
    got = _grads(out, state, dout, dstate.float(), leaves)
    want = _grads(ref, ref_state, dout, dstate.float(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
