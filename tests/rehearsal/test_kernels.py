"""`DeviceKernels`: a fake op answers as the rehearsed device's kernel does, where torch's
meta kernel is stricter (the CPU's `_grouped_mm` off bf16, HF's MoE experts)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longstraw.rehearsal.kernels import DeviceKernels, needs_device_kernels

OFFS = [3, 7, 16]
LAYOUTS = [  # (a, b, offs?): tokens x experts' weights (HF's forward), and the backward's three
    ((16, 8), (3, 8, 8), True),
    ((8, 16), (16, 8), True),
    ((3, 16, 8), (8, 16), True),
    ((3, 8, 8), (3, 8, 8), False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fake_grouped_mm_off_bf16_is_the_cpu_kernel_s_output(dtype):
    """Each layout's fake output has the real CPU kernel's shape, strides, dtype and bytes;
    the fake mode alone refuses it (its meta kernel takes only bf16)."""
    for a_shape, b_shape, with_offs in LAYOUTS:
        a, b = torch.randn(a_shape, dtype=dtype), torch.randn(b_shape, dtype=dtype)
        offs = torch.tensor(OFFS, dtype=torch.int32) if with_offs else None
        real = torch._grouped_mm(a, b, offs)
        mode = FakeTensorMode()
        fa, fb, fo = (mode.from_tensor(t) if t is not None else None for t in (a, b, offs))
        with mode, DeviceKernels():
            fake = torch._grouped_mm(fa, fb, fo)
        got = (fake.shape, fake.stride(), fake.dtype, fake.untyped_storage().nbytes())
        assert got == (real.shape, real.stride(), real.dtype, real.untyped_storage().nbytes()), (a_shape, b_shape)
        with mode, pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(fa, fb, fo)


def test_fake_grouped_mm_refuses_what_the_cpu_kernel_refuses():
    """float64 and a 20-byte row stride: refused on fake tensors as on real ones."""
    mode = FakeTensorMode()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    for a, b in [(torch.randn(16, 8, dtype=torch.float64), torch.randn(3, 8, 4, dtype=torch.float64)),
                 (torch.randn(16, 8), torch.randn(3, 8, 5))]:
        with pytest.raises(RuntimeError):
            torch._grouped_mm(a, b, offs)
        with mode, DeviceKernels(), pytest.raises(RuntimeError):
            torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(offs))


def test_device_kernels_are_entered_only_where_they_can_apply():
    assert needs_device_kernels("cpu", torch.float32)
    assert not needs_device_kernels("cpu", torch.bfloat16)
    assert not needs_device_kernels("cuda", torch.float32)  # CUDA's kernel is the meta kernel's rule
