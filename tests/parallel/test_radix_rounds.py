"""One radix round of the global top-k as two registered ops (`parallel/radix_rounds.py`):
each op equals its plain implementation, each declared workspace bounds that
implementation's measured peak from above within 1% (sign and plain digits, wide and narrow
rows), and on fake tensors a round is the two ops. The selection across ranks:
tests/parallel/test_topk.py (gloo, W = 2, 3, 4, through the ops)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.parallel.radix_rounds import (histogram, histogram_bytes, narrow, narrow_bytes, radix_histogram,
                                             radix_narrow)
from longstraw.rehearsal.tracker import LiveBytes


def _round(b, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    word = torch.randint(-2**31, 2**31, (b, n), generator=gen)
    match = torch.rand(b, n, generator=gen) > 0.3
    need = torch.randint(1, 5, (b,), generator=gen)
    return word, match, need, torch.zeros(b, dtype=torch.long)


@pytest.mark.parametrize("sign", [True, False])
@pytest.mark.parametrize("b,n", [(8, 100), (3, 2048), (64, 1)])
def test_the_ops_are_the_round_and_their_workspace_bounds_its_peak_within_one_percent(b, n, sign):
    word, match, need, value = _round(b, n)
    shift = 28 if sign else 12
    hist = radix_histogram(word, match, shift, sign)
    assert torch.equal(hist, histogram(word, match, shift, sign))
    tracker = LiveBytes("cpu")
    tracker.adopt([word, match])
    base = tracker.live
    with tracker, tracker.phase("op"):
        histogram(word, match, shift, sign)
    peak = tracker.phase_peaks["op"] - base  # its output included: it is made inside the op
    assert peak <= histogram_bytes(word, match, shift, sign) <= 1.01 * peak, (peak, histogram_bytes(word, match,
                                                                                                   shift, sign))
    plain = [x.clone() for x in (match, need, value)]
    radix_narrow(hist, word, match, need, value, shift, sign)
    tracker = LiveBytes("cpu")
    tracker.adopt([hist, word, *plain])
    with tracker, tracker.phase("op"):
        narrow(hist, word, *plain, shift, sign)
    peak = tracker.phase_peaks["op"] - tracker.live
    assert all(torch.equal(x, y) for x, y in zip((match, need, value), plain))
    assert peak <= narrow_bytes(hist, word, *plain, shift, sign) <= 1.01 * peak


def test_on_fake_tensors_a_round_is_two_ops():
    real = _round(4, 50)
    with FakeTensorMode() as mode:
        word, match, need, value = (mode.from_tensor(x) for x in real)
        tracker = LiveBytes("cpu")
        with tracker:
            hist = radix_histogram(word, match, 28, True)
            radix_narrow(hist, word, match, need, value, 28, True)
    assert tracker.ops == 2 and hist.shape == (4, 16) and hist.dtype == torch.int32
