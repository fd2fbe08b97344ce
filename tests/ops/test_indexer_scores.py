"""DSA's indexer scores as one registered op (`ops/indexer_scores.py`): the op equals the
naive formula (float64, a key block that does not divide n), it writes into a column view
in place, a fake call is one op whose declared workspace equals the loop's measured peak,
and its FLOPs are the loop's matmuls as the counter counts them unregistered."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from longstraw.ops.dsa import indexer_scores
from longstraw.ops.indexer_scores import indexer_scores_into, score_blocks, workspace_bytes
from longstraw.rehearsal.tracker import LiveBytes

T, HI, DI, N, KB = 6, 4, 8, 23, 5


def _args(dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(T, HI, DI), mk(T, HI), mk(N, DI)


def test_the_op_equals_the_naive_scores_and_writes_a_column_view():
    q, w, k = _args()
    naive = (w[:, :, None] * torch.relu(0.3 * torch.einsum("thd,nd->thn", q, k))).sum(1)  # [T, N]
    torch.testing.assert_close(indexer_scores(q, w, k, scale=0.3, key_block=KB), naive, rtol=0, atol=1e-13)
    wide = torch.full((T, N + 7), -1.0, dtype=torch.float64)
    indexer_scores(q, w, k, scale=0.3, key_block=KB, out=wide[:, 3:3 + N])
    torch.testing.assert_close(wide[:, 3:3 + N], naive, rtol=0, atol=1e-13)
    assert bool((wide[:, :3] == -1).all() and (wide[:, 3 + N:] == -1).all())  # columns outside left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fake_call_is_one_op_its_workspace_is_the_loop_s_and_its_flops_the_matmuls(dtype):
    q, w, k = _args(dtype, seed=1)
    out = torch.empty(T, N, dtype=torch.float32)
    tracker = LiveBytes("cpu")  # the plain loop, op by op: its peak above what it was given
    tracker.adopt([q, w, k, out])
    with tracker, tracker.phase("capture"):
        score_blocks(q, w, k, out, 0.3, KB)
    loop_peak = tracker.phase_peaks["capture"] - tracker.live
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(a) for a in (q, w, k, out)]
        tracker = LiveBytes("cpu")
        with tracker, tracker.phase("capture"):
            indexer_scores_into(*fake, 0.3, KB)
    assert tracker.ops == 1
    declared = workspace_bytes(*fake, 0.3, KB)
    assert tracker.phase_peaks["capture"] == tracker.live + declared
    assert declared == loop_peak > 0, (declared, loop_peak)
    with FlopCounterMode(display=False) as registered:
        indexer_scores_into(q, w, k, out, 0.3, KB)
    with FlopCounterMode(display=False) as loop:
        score_blocks(q, w, k, out, 0.3, KB)
    assert registered.get_total_flops() == loop.get_total_flops() == 2 * T * HI * N * (DI + 1)
