"""Engine internals that the end-to-end tests cannot see on CPU."""

import torch

from longstraw import engine


def test_phase_timestamps_wait_for_cuda_kernels(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    engine._clock(torch.device("cpu"))
    assert synced == []
    engine._clock(torch.device("cuda", 0))
    assert synced == [torch.device("cuda", 0)]


def test_branch_statistics_stay_on_the_device_until_read():
    stats = engine._BranchStats()
    for _ in range(3):
        stats.add(torch.tensor(0.5), {"ratio": torch.ones(4), "clipped": torch.zeros(4)})
    assert isinstance(stats.loss, torch.Tensor) and isinstance(stats.ratio, torch.Tensor)  # no float() per piece
    assert float(stats.loss) == 1.5 and stats.summary(with_kl=False) == {"ratio_mean": 1.0, "clip_fraction": 0.0}
