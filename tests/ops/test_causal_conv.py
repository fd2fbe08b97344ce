"""Depthwise causal conv with a carried tail, against the naive loop (float64) and HF."""

import pytest
import torch

from longstraw.ops.causal_conv import causal_conv1d_with_tail
from longstraw.ops.naive import naive_causal_conv1d


def _inputs(c, t, kw, tail=True, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    x, w = mk(c, t), mk(c, kw)
    b = mk(c) if bias else None
    tl = mk(c, kw - 1) if tail else None
    dy, dtail = torch.randn(c, t, generator=gen, dtype=torch.float64), torch.randn(c, kw - 1, generator=gen,
                                                                                   dtype=torch.float64)
    return (x, w, b, tl), dy, dtail


@pytest.mark.parametrize(
    "c,t,kw,tail,bias,act",
    [(5, 9, 4, True, True, "silu"), (5, 9, 4, False, False, "silu"), (3, 1, 4, True, True, "silu"),
     (3, 2, 4, True, False, None), (4, 7, 1, False, True, "silu"), (6, 3, 3, True, True, "silu")],
)
def test_matches_naive_output_tail_and_every_input_grad(c, t, kw, tail, bias, act):
    args, dy, dtail = _inputs(c, t, kw, tail, bias)
    y, new_tail = causal_conv1d_with_tail(*args, activation=act)
    ref, ref_tail = naive_causal_conv1d(*args, activation=act)
    assert y.shape == (c, t) and new_tail.shape == (c, kw - 1)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_tail, ref_tail, rtol=0, atol=0)
    wrt = [a for a in args if a is not None]
    got = torch.autograd.grad((y, new_tail), wrt, (dy, dtail), allow_unused=True)
    want = torch.autograd.grad((ref, ref_tail), wrt, (dy, dtail), allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("split", [1, 2, 5, 10])
def test_two_pieces_with_carried_tail_equal_one_call(split):
    (x, w, b, tl), dy, dtail = _inputs(5, 11, 4)
    y, last = causal_conv1d_with_tail(x, w, b, tl)
    y1, t1 = causal_conv1d_with_tail(x[:, :split], w, b, tl)
    y2, t2 = causal_conv1d_with_tail(x[:, split:], w, b, t1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(t2, last, rtol=0, atol=0)
    got = torch.autograd.grad((torch.cat([y1, y2], 1), t2), (x, w, b, tl), (dy, dtail))
    want = torch.autograd.grad((y, last), (x, w, b, tl), (dy, dtail))
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_short_piece_keeps_part_of_the_old_tail():
    (x, w, b, tl), _, _ = _inputs(3, 2, 5)  # T = 2 < K - 1 = 4
    _, new_tail = causal_conv1d_with_tail(x, w, b, tl)
    torch.testing.assert_close(new_tail, torch.cat([tl[:, 2:], x], 1), rtol=0, atol=0)


def test_inputs_untouched():
    args, dy, dtail = _inputs(4, 6, 4)
    before = [a.detach().clone() for a in args]
    y, new_tail = causal_conv1d_with_tail(*args)
    ((y * dy).sum() + (new_tail * dtail).sum()).backward()
    for a, a0 in zip(args, before):
        assert torch.equal(a.detach(), a0) and a.grad is not None


def test_matches_hf_causal_conv1d_fn_from_start_and_with_cached_context():
    """Sequence start: HF pads K-1 zeros. Continuation: HF's cache path convolves
    cat(conv_state, x) and keeps the last T outputs; any K-1 leading columns of that
    state play the role of our tail."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    (x, w, b, tl), _, _ = _inputs(6, 9, 4)
    with torch.no_grad():
        hf = causal_conv1d_fn(x[None], w, b, activation="silu")[0]
        y, _ = causal_conv1d_with_tail(x, w, b, None)
        torch.testing.assert_close(y, hf, rtol=1e-12, atol=1e-12)
        hf_cont = causal_conv1d_fn(torch.cat([tl, x], 1)[None], w, b, activation="silu")[0, :, -x.shape[1]:]
        y_cont, _ = causal_conv1d_with_tail(x, w, b, tl)
        torch.testing.assert_close(y_cont, hf_cont, rtol=1e-12, atol=1e-12)
