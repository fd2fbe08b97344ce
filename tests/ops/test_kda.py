"""Chunked Kimi Delta Attention against the token-by-token naive twin (float64) and HF's
own torch fallback (`chunk_kimi_delta_attention`): outputs, final state and every input
gradient (initial state included) under random upstream gradients into both."""

import pytest
import torch

from longstraw.ops.kda import chunk_kda, kda_step
from longstraw.ops.naive import naive_kda

DK, DV = 8, 6


def _inputs(t, h, init=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = mk(t, h, DK), mk(t, h, DK), mk(t, h, DV)
    g = -torch.rand(t, h, DK, generator=gen, dtype=torch.float64) * 0.8  # per-channel log decay in (-0.8, 0]
    beta = torch.rand(t, h, generator=gen, dtype=torch.float64)
    h0 = mk(h, DK, DV) * 0.5 if init else None
    dout, dstate = mk(t, h, DV), mk(h, DK, DV)
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, g, beta, h0)], dout, dstate


def _grads(out, state, dout, dstate, leaves):
    return torch.autograd.grad((out, state), [x for x in leaves if x is not None], (dout, dstate))


@pytest.mark.parametrize("t,chunk,h,init,l2", [
    (1, 16, 2, True, True), (5, 16, 2, False, True), (16, 4, 3, True, True), (37, 8, 2, True, True),
    (37, 64, 1, True, False), (13, 1, 2, True, True),
])
def test_matches_naive_output_state_and_every_input_grad(t, chunk, h, init, l2):
    leaves, dout, dstate = _inputs(t, h, init)
    if not l2:  # keep the un-normalised recurrence contractive
        with torch.no_grad():
            leaves[1].mul_(0.3)
    out, state = chunk_kda(*leaves, chunk_size=chunk, use_qk_l2norm=l2)
    ref, ref_state = naive_kda(*leaves, use_qk_l2norm=l2)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(out, state, dout, dstate, leaves), _grads(ref, ref_state, dout, dstate, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_per_channel_decay_really_differs_from_a_per_head_one():
    """The same inputs with g averaged over channels give other outputs (the test above
    would not notice an op that used one decay per head only if g were constant)."""
    (q, k, v, g, beta, h0), _, _ = _inputs(9, 2, seed=4)
    out, _ = chunk_kda(q, k, v, g, beta, h0, chunk_size=4)
    mean, _ = chunk_kda(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta, h0, chunk_size=4)
    assert (out - mean).abs().max() > 1e-3


def test_decode_steps_equal_the_scan():
    runs = [_inputs(4, 2, seed=s)[0] for s in range(3)]
    state = torch.stack([r[5] for r in runs]).detach()
    for t in range(4):
        q, k, v, g, beta = (torch.stack([r[i][t] for r in runs]).detach() for i in range(5))
        out, state = kda_step(q, k, v, g, beta, state)
    for i, r in enumerate(runs):
        want, want_state = naive_kda(*(x.detach() for x in r))
        torch.testing.assert_close(out[i], want[-1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[i], want_state, rtol=1e-12, atol=1e-12)


def test_matches_hf_kimi_linear_torch_chunk_reference():
    """HF's fallback computes in float32 (its own casts); compared at float32 precision."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    (q, k, v, g, beta, h0), _, _ = _inputs(37, 2, seed=2)
    out, state = chunk_kda(q, k, v, g, beta, h0, chunk_size=16)
    ref, ref_state = hf.chunk_kimi_delta_attention(  # fla is not installed: HF's torch fallback
        *(x.detach()[None] for x in (q, k, v, g, beta)), chunk_size=16, initial_state=h0.detach()[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out.detach(), ref[0], rtol=1e-4, atol=1e-5, check_dtype=False)
    torch.testing.assert_close(state.detach().float(), ref_state[0], rtol=1e-4, atol=1e-5)
    assert (out.detach() - ref[0]).abs().max() > 0  # HF's really is float32: not the same function run twice


def test_bad_shapes_name_the_expected_shape():
    (q, k, v, g, beta, h0), _, _ = _inputs(5, 2)
    with pytest.raises(ValueError, match=r"\[H, Dk, Dv\] = \(2, 8, 6\)"):
        chunk_kda(q, k, v, g, beta, h0.transpose(1, 2))
    with pytest.raises(ValueError, match="q, k and g"):
        chunk_kda(q, k, v, g[..., 0], beta)


@pytest.mark.parametrize("t,chunk", [(1, 4), (11, 4), (16, 64)])
def test_transition_is_the_scan_from_any_start_state(t, chunk):
    """Context parallelism's affine map: read @ S + out0 and A @ S + C equal the scan
    from S, for a random start state S (and for S = 0)."""
    from longstraw.ops.gated_delta_scan import apply_transition, finish_outputs
    from longstraw.ops.kda import kda_transition

    (q, k, v, g, beta, h0), _, _ = _inputs(t, 2, seed=7)
    read, out0, a, c = kda_transition(q, k, v, g, beta, chunk_size=chunk)
    for start in (h0.detach(), None):
        out, end = chunk_kda(q, k, v, g, beta, start, chunk_size=chunk)
        torch.testing.assert_close(finish_outputs(read, out0, start), out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(apply_transition(a, c, start), end, rtol=1e-10, atol=1e-10)
