"""The gated delta rule as an affine map of its state (`ops/gated_delta_scan.py`), float64.

The transition (read, out0, A, C) of a segment equals the naive token-by-token product,
and composing the segments of a sequence in order (the scan that context parallelism
runs across ranks) gives the same outputs and end state as the naive recurrence over the
whole sequence, for segment lengths that do and do not divide the rule's chunk."""

import pytest
import torch

from longstraw.ops.gated_delta_scan import apply_transition, chain_states, finish_outputs, gated_delta_transition
from longstraw.ops.naive import naive_gated_delta_rule, naive_gated_delta_transition


def _inputs(t, hk=2, hv=4, dk=5, dv=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return (r(t, hk, dk), r(t, hk, dk), r(t, hv, dv), -torch.rand(t, hv, generator=gen, dtype=torch.float64),
            torch.rand(t, hv, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("t,chunk", [(1, 4), (7, 4), (12, 4), (9, 64)])
def test_transition_equals_the_naive_product(t, chunk):
    q, k, v, g, beta = _inputs(t)
    got = gated_delta_transition(q, k, v, g, beta, chunk_size=chunk)
    want = naive_gated_delta_transition(q, k, v, g, beta)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cuts", [[0, 5, 6, 13, 20], [0, 20], [0, 1, 2, 3, 20], [0, 8, 16, 20]])
def test_segments_composed_in_order_equal_the_sequential_recurrence(cuts):
    q, k, v, g, beta = _inputs(20, seed=1)
    start = torch.randn(4, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want_out, want_end = naive_gated_delta_rule(q, k, v, g, beta, start)
    parts = [gated_delta_transition(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], chunk_size=4)
             for a, b in zip(cuts, cuts[1:])]
    # one rank (cp=None is rank 0): every segment's start state comes from the previous one
    links = [(0, None)] * len(parts)
    first_a, first_c = parts[0][2], apply_transition(parts[0][2], parts[0][3], start)
    chained = chain_states([(first_a, first_c)] + [(p[2], p[3]) for p in parts[1:]],
                           [(-1, None)] + links[1:], None, start.shape, start.dtype, start.device)
    outs = [finish_outputs(parts[0][0], parts[0][1], start)]
    outs += [finish_outputs(p[0], p[1], s) for p, (s, _) in zip(parts[1:], chained[1:])]
    torch.testing.assert_close(torch.cat(outs), want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chained[-1][1], want_end, rtol=1e-10, atol=1e-12)
