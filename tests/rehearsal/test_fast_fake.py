"""RehearsalFakeMode (longstraw/rehearsal/fast_fake.py) against torch's FakeTensorMode:
the same rehearsal gives the same figures, and `_unsafe_view` keeps its input's storage."""

from __future__ import annotations

import torch

import longstraw as ls
from longstraw.rehearsal.fast_fake import RehearsalFakeMode
from longstraw.tiny import tiny_model


def _figures(monkeypatch, fast: str) -> dict:
    monkeypatch.setenv("LONGSTRAW_FAST_FAKE", fast)
    r = ls.rehearse(tiny_model("qwen3_5").config, ls.ExecConfig(chunk_size=16, mode="detached", branch_chunk_size=4),
                    prompt_tokens=64, group=2, response_tokens=8, device="cpu", dtype=torch.bfloat16)
    d = r.as_dict()
    d.pop("wall_s")
    return d


def test_a_rehearsal_in_the_fast_mode_equals_torch_s(monkeypatch):
    """Peak, every phase, FLOPs, host syncs and op count bit-equal under both fake modes."""
    assert _figures(monkeypatch, "1") == _figures(monkeypatch, "0")


def test_unsafe_view_shares_its_input_s_storage():
    """Served as a view from the cache (torch dispatches it in full): same storage, sizes, strides."""
    with RehearsalFakeMode():
        x = torch.empty(8, 6)
        for _ in range(2):  # the second call is a cache hit
            y = torch.ops.aten._unsafe_view.default(x, [2, 4, 6])
            assert y.untyped_storage()._cdata == x.untyped_storage()._cdata
            assert y.shape == (2, 4, 6) and y.stride() == (24, 6, 1)
