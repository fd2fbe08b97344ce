"""Kernel selection (`ops/flash.select_kernel`, `kernel_for`): torch's fused flash
kernel only where the device supports it, the blockwise kernel everywhere else. Runs on
CPU: the CUDA facts (compute capability, the flash switch) are faked."""

import pytest
import torch

from longstraw.ops import flash

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64

# (device type, capability, D, Dv, dtype, flash switch) -> kernel
TABLE = [
    ("cuda", (8, 0), 128, 128, BF16, True, "flash"),      # A100
    ("cuda", (9, 0), 64, 64, FP16, True, "flash"),        # H100 / H200
    ("cuda", (8, 6), 256, 256, BF16, True, "flash"),      # the largest head dim
    ("cuda", (7, 0), 128, 128, BF16, True, "blockwise"),  # V100
    ("cuda", (7, 5), 64, 64, FP16, True, "blockwise"),    # T4
    ("cuda", (8, 0), 100, 100, BF16, True, "blockwise"),  # D not a multiple of 8
    ("cuda", (9, 0), 12, 12, BF16, True, "blockwise"),
    ("cuda", (9, 0), 264, 264, BF16, True, "blockwise"),  # D > 256
    ("cuda", (9, 0), 128, 128, FP32, True, "blockwise"),  # FlashAttention-2 is half precision only
    ("cuda", (9, 0), 128, 128, BF16, False, "blockwise"),  # torch.backends.cuda.enable_flash_sdp(False)
    ("cuda", (9, 0), 192, 128, BF16, True, "blockwise"),  # Dv != D (absorbed MLA)
    ("cuda", None, 128, 128, BF16, True, "blockwise"),
    ("cpu", None, 12, 12, FP64, True, "flash"),           # CPU: any D
    ("cpu", None, 100, 100, FP32, True, "flash"),
    ("cpu", None, 64, 64, BF16, True, "flash"),
    ("cpu", None, 64, 64, FP16, True, "blockwise"),
    ("cpu", None, 64, 64, FP32, False, "blockwise"),
    ("cpu", None, 64, 32, FP32, True, "blockwise"),
    ("mps", None, 64, 64, FP16, True, "blockwise"),
]


@pytest.mark.parametrize("device,cap,d,dv,dtype,switch,want", TABLE)
def test_selection_table(device, cap, d, dv, dtype, switch, want):
    assert flash.select_kernel(device, cap, d, dv, dtype, fused_enabled=True, flash_sdp_enabled=switch) == want
    assert flash.select_kernel(device, cap, d, dv, dtype, fused_enabled=False, flash_sdp_enabled=switch) == "blockwise"


@pytest.mark.parametrize("cap,d,want", [((7, 0), 128, "blockwise"), ((8, 0), 128, "flash"), ((9, 0), 100, "blockwise"),
                                         ((9, 0), 300, "blockwise")])
def test_kernel_for_reads_the_devices_capability(monkeypatch, cap, d, want):
    """`kernel_for` (what every attention op asks through `fused_takes`) reads the CUDA
    device's capability and torch's flash switch; a window always runs blockwise."""
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (seen.append(device), cap)[1])
    cuda = torch.device("cuda", 1)
    assert flash.kernel_for(cuda, d, d, BF16) == want
    assert seen == [cuda]
    assert flash.kernel_for(cuda, d, d, BF16, window=16) == "blockwise"
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    assert flash.kernel_for(cuda, d, d, BF16) == "blockwise"


def test_cpu_queries_take_the_fused_kernel_unless_switched_off(monkeypatch):
    q = torch.zeros(2, 3, 12, dtype=FP64)
    assert flash.fused_takes(q, 12, None) and not flash.fused_takes(q, 8, None)
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)
    assert not flash.fused_takes(q, 12, None)
