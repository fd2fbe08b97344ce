"""Chunked Mamba2 (SSD) scan against the token-by-token naive twin (float64): outputs,
final state and every input gradient (the initial state's included) under random
upstream gradients into both; decode steps; the affine transition of a segment."""

import pytest
import torch

from longstraw.ops.naive import naive_ssd_scan
from longstraw.ops.ssd import chunk_ssd_scan, diagonal_transition, finish_ssd_outputs, ssd_step, ssd_transition

P, N = 6, 5  # head dim and d_state differ on purpose, so a transposed state cannot pass


def _inputs(t, h, groups, init=True, seed=0):
    """Leaves x, dt, A, B, C, h0 (h0 None when not init) and cotangents for (y, state)."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, b, c = mk(t, h, P), mk(t, groups, N), mk(t, groups, N)
    dt = torch.nn.functional.softplus(mk(t, h))  # > 0, as after softplus
    a = -torch.rand(h, generator=gen, dtype=torch.float64) * 2 - 0.1  # A < 0
    h0 = mk(h, P, N) * 0.5 if init else None
    dy, dstate = mk(t, h, P), mk(h, P, N)
    leaves = [z.requires_grad_() if z is not None else None for z in (x, dt, a, b, c, h0)]
    return leaves, dy, dstate


def _grads(y, state, dy, dstate, leaves):
    return torch.autograd.grad((y, state), [z for z in leaves if z is not None], (dy, dstate))


@pytest.mark.parametrize("t,chunk,h,groups,init", [
    (1, 4, 2, 1, True), (1, 16, 2, 2, False), (5, 4, 4, 2, True), (16, 4, 2, 1, True),
    (37, 8, 4, 1, True), (37, 64, 3, 3, False), (13, 1, 2, 2, True),
])
def test_matches_naive_output_state_and_every_input_grad(t, chunk, h, groups, init):
    """Chunk sizes of 1, one dividing T, one that does not and one larger than T."""
    leaves, dy, dstate = _inputs(t, h, groups, init)
    y, state = chunk_ssd_scan(*leaves, chunk_size=chunk)
    ref, ref_state = naive_ssd_scan(*leaves)
    assert y.shape == (t, h, P) and state.shape == (h, P, N) and y.dtype == state.dtype == torch.float64
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)
    for got, want in zip(_grads(y, state, dy, dstate, leaves), _grads(ref, ref_state, dy, dstate, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_gradcheck_small():
    leaves, _, _ = _inputs(5, 2, 1, init=True, seed=3)
    torch.autograd.gradcheck(lambda *xs: chunk_ssd_scan(*xs, chunk_size=2), tuple(leaves), fast_mode=True)


@pytest.mark.parametrize("split", [1, 7, 8, 29])
def test_two_calls_with_carried_state_equal_one_call(split):
    """Capture -> replay: the first part's final state starts the second part, and
    gradients flow back through the hand-over."""
    leaves, dy, dstate = _inputs(30, 4, 2, init=True, seed=1)
    x, dt, a, b, c, h0 = leaves
    y, state = chunk_ssd_scan(x, dt, a, b, c, h0, chunk_size=8)
    y1, s1 = chunk_ssd_scan(x[:split], dt[:split], a, b[:split], c[:split], h0, chunk_size=8)
    y2, s2 = chunk_ssd_scan(x[split:], dt[split:], a, b[split:], c[split:], s1, chunk_size=8)
    torch.testing.assert_close(torch.cat([y1, y2]), y, rtol=1e-10, atol=1e-10)
    for got, want in zip(_grads(torch.cat([y1, y2]), s2, dy, dstate, leaves), _grads(y, state, dy, dstate, leaves)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_decode_steps_equal_the_scan_per_sequence():
    """Three sequences stepped together, each from its own state, equal three scans."""
    runs = [_inputs(4, 4, 2, init=True, seed=s)[0] for s in range(3)]
    state = torch.stack([r[5] for r in runs]).detach()
    a = runs[0][2].detach()
    for t in range(4):
        x, dt, b, c = (torch.stack([r[i][t] for r in runs]).detach() for i in (0, 1, 3, 4))
        y, state = ssd_step(x, dt, a, b, c, state)
    for i, r in enumerate(runs):
        want_y, want_state = naive_ssd_scan(r[0].detach(), r[1].detach(), a, r[3].detach(), r[4].detach(),
                                            r[5].detach())
        torch.testing.assert_close(y[i], want_y[-1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state[i], want_state, rtol=1e-12, atol=1e-12)


def test_transition_is_the_scan_from_any_start_state():
    (x, dt, a, b, c, h0), _, _ = _inputs(11, 4, 2, init=True, seed=5)
    read, out0, decay, end0 = ssd_transition(x, dt, a, b, c, chunk_size=4)
    want_y, want_state = naive_ssd_scan(x, dt, a, b, c, h0)
    torch.testing.assert_close(finish_ssd_outputs(read, out0, h0), want_y, rtol=1e-10, atol=1e-10)
    mat, add = diagonal_transition(decay, end0)
    torch.testing.assert_close(torch.baddbmm(add, mat, h0), want_state, rtol=1e-10, atol=1e-10)


def test_bad_shapes_name_the_expected_shape():
    (x, dt, a, b, c, h0), _, _ = _inputs(5, 4, 2)
    with pytest.raises(ValueError, match=r"\[H, P, N\] = \(4, 6, 5\)"):
        chunk_ssd_scan(x, dt, a, b, c, h0.transpose(1, 2))
    with pytest.raises(ValueError, match="G dividing H=4"):
        chunk_ssd_scan(x, dt, a, b[:, :1].expand(5, 3, N), c[:, :1].expand(5, 3, N))
