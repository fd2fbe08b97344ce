"""A divided capture's runs of own query rows over one set of keys as one registered op
(`ops/divided_runs.py`): the op equals the plain loop bit for bit and the loop equals
`merge_partials` of each run's partial (float64, causal and not), a fake call is one op
whose declared workspace covers the loop's measured peak, and its FLOPs are torch's formula
for the partials' fused attention."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from longstraw.ops.divided_runs import attend_runs, divided_attention_runs, partial_attention, workspace_bytes
from longstraw.ops.flash import merge_partials
from longstraw.rehearsal.tracker import LiveBytes

HKV, G, N, S, D = 2, 3, 20, 11, 8
RUNS = [0, 7, 0, 11, 7, 12, 2, 9, 15, 20, 0, 4]  # (a, b, lo, hi): rows a .. b - 1 over keys lo .. hi - 1


def _args(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    out = torch.randn(HKV, G, N, D, generator=gen, dtype=torch.float64).to(torch.float32 if dtype != torch.float64
                                                                          else dtype)
    return mk(HKV * G, N, D), mk(HKV, S, D), mk(HKV, S, D), out, torch.randn(HKV, G, N, generator=gen).to(out.dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_the_op_equals_the_loop_and_the_loop_merges_each_partial(causal):
    runs = [0, 7, 0, 7, 7, 11, 0, 4] if causal else RUNS  # causal: query rows and keys of one length
    q, k, v, out, lse = _args()
    mine, ref = (out.clone(), lse.clone()), (out.clone(), lse.clone())
    divided_attention_runs(q, k, v, *mine, runs, 0.3, causal)
    attend_runs(q, k, v, *ref, runs, 0.3, causal)
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])
    want_o, want_l = out.clone(), lse.clone()  # the naive twin: merge_partials, run by run
    for i in range(0, len(runs), 4):
        a, b, lo, hi = runs[i:i + 4]
        o_p, l_p = partial_attention(q[:, a:b], k[:, lo:hi], v[:, lo:hi], 0.3, causal)
        o_p, l_p = o_p.view(HKV, G, b - a, D), l_p.view(HKV, G, b - a)
        want_o[:, :, a:b] = merge_partials(o_p, l_p, want_o[:, :, a:b], want_l[:, :, a:b])
        want_l[:, :, a:b] = torch.logaddexp(l_p, want_l[:, :, a:b])
    torch.testing.assert_close(mine[0], want_o, rtol=0, atol=1e-13)
    torch.testing.assert_close(mine[1], want_l, rtol=0, atol=1e-13)
    untouched = torch.ones(N, dtype=torch.bool)
    for i in range(0, len(runs), 4):
        untouched[runs[i]:runs[i + 1]] = False
    assert torch.equal(mine[0][:, :, untouched], out[:, :, untouched])  # rows no run names are left alone


def test_a_fake_call_is_one_op_its_workspace_covers_the_loop_and_its_flops_are_the_partials():
    q, k, v, out, lse = _args(torch.float32, seed=1)
    tracker = LiveBytes("cpu")  # the plain loop, op by op: its peak above what it was given
    tracker.adopt([q, k, v, out, lse])
    with tracker, tracker.phase("capture"):
        attend_runs(q, k, v, out.clone(), lse.clone(), RUNS, 0.3, False)
    loop_peak = tracker.phase_peaks["capture"] - tracker.live - out.nbytes - lse.nbytes
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) for a in (q, k, v, out, lse)]
        tracker = LiveBytes("cpu")
        with tracker, tracker.phase("capture"):
            divided_attention_runs(*fake, RUNS, 0.3, False)
    assert tracker.ops == 1
    declared = workspace_bytes(*fake, RUNS, 0.3, False)
    assert tracker.phase_peaks["capture"] == tracker.live + declared
    assert loop_peak <= declared <= 1.5 * loop_peak, (loop_peak, declared)
    with FlopCounterMode(display=False) as flops:
        divided_attention_runs(q, k, v, out.clone(), lse.clone(), RUNS, 0.3, False)
    # torch's formula for each run's fused attention (the CUDA flash op's; the CPU one has none)
    want = sum(sdpa_flop_count((1, HKV * G, RUNS[i + 1] - RUNS[i], D), (1, HKV * G, RUNS[i + 3] - RUNS[i + 2], D),
                               (1, HKV * G, RUNS[i + 3] - RUNS[i + 2], D)) for i in range(0, len(RUNS), 4))
    assert flops.get_total_flops() == want > 0
