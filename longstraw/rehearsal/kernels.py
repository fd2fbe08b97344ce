"""Fake outputs where torch's meta kernel is stricter than the rehearsed device's kernel.

A fake tensor's op runs the op's meta kernel, which for some ops checks the CUDA kernel's
rules rather than the device's. `aten._grouped_mm` (HF's MoE experts' default forward,
and its backward) is one: its meta kernel refuses anything but bf16 ("Expected inputs of
BF16 type"), while the CPU kernel multiplies float32 and float16 too. A float32 MoE
model then runs for real on the CPU but does not rehearse. `DeviceKernels` answers such
an op on CPU fake tensors with the output the CPU kernel returns (contiguous, unpadded:
the sizes of `torch._meta_registrations._create_grouped_mm_output_tensor` without its
CUDA stride padding), after the CPU kernel's own checks (float32 / float16, the
contraction sizes, strides in multiples of 16 bytes); every other op, and every CUDA,
bf16 or float64 call, goes on to the fake mode unchanged (float64 is refused there, as
the CPU kernel refuses it). `rehearse` enters it only where it can apply (a CPU rehearsal of a model
not in bf16), so a bf16 rehearsal pays no extra dispatch per op.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GROUPED_MM = torch.ops.aten._grouped_mm.default
_CPU_DTYPES = (torch.float32, torch.float16)  # what the CPU kernel takes besides bf16


def grouped_mm_size(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The output size of `torch._grouped_mm(a, b, offs)`: a [M, K] b [G, K, N] -> [M, N];
    a [K, M] b [M, N] (offs [G]) -> [G, K, N]; a [G, M, K] b [K, N] -> [M, N];
    a [G, M, K] b [G, K, N] -> [G, M, N]."""
    if a.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    return [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]


def _aligned(t: torch.Tensor) -> bool:
    """The kernel's layout rule: row- or column-major in the last two dims, the leading
    stride a multiple of 16 bytes."""
    s, n = t.stride(), t.shape
    if s[-2] == 1 and s[-1] >= max(1, n[-2]):
        return s[-1] * t.element_size() % 16 == 0
    return s[-1] == 1 and s[-2] >= max(1, n[-1]) and s[-2] * t.element_size() % 16 == 0


def needs_device_kernels(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a rehearsal on `device_type` with weights in `dtype` can meet a meta kernel
    stricter than its device's (the CPU's grouped_mm beyond bf16)."""
    return device_type == "cpu" and dtype != torch.bfloat16


class DeviceKernels(TorchDispatchMode):
    """Enter inside a `FakeTensorMode` (and below any tracker): a CPU `_grouped_mm` off
    bf16 gets the CPU kernel's output, an empty contiguous tensor of its size."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM:
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
            if a.device.type == "cpu" and a.dtype in _CPU_DTYPES and a.dtype == b.dtype:
                torch._check(a.size(-1) == b.size(-2) or (a.dim() == 2 and b.dim() == 2),
                             lambda: "contraction dimension of mat_a and mat_b must match")
                torch._check(_aligned(a) and _aligned(b), lambda: "strides should be multiple of 16 bytes")
                return torch.empty(grouped_mm_size(a, b, offs), dtype=out_dtype, device=a.device)
        return func(*args, **kwargs)
