"""The `longstraw` command's own logic (the library is tested elsewhere)."""

import torch

from longstraw import cli


def test_torchrun_with_cuda_picks_nccl_on_the_local_rank_device(monkeypatch):
    import torch.distributed as dist

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    rank, device = cli._init_torchrun()
    assert (rank, device, seen["backend"], seen["set_device"]) == (3, torch.device("cuda", 3), "nccl", device)


def test_without_torchrun_the_demo_stays_on_cpu(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli._init_torchrun() == (None, torch.device("cpu"))
