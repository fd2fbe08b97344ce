"""One host buffer per offloaded state, carved into exact views (state offload's host
memory, `offload.py`).

Why: torch's pinned (CUDA host) allocator rounds every block up to a power of two, so
one pinned tensor per layer and per gradient took up to 2x (about 1.8x in practice)
the bytes the planner counted. Offload instead allocates, per state, one byte buffer
for the per-token rows and (exact mode) one for their gradient rows, and hands out
views into it:

    buffer  uint8 [total]          total = sum of the tensors' bytes, each rounded up
    view i  buffer[off_i : off_i + nbytes_i].view(dtype_i).view(shape_i)

with every offset a multiple of `plan.offload.ARENA_ALIGN` (the planner's own
arithmetic, `arena_offsets`, so its host bytes are these buffers' sizes). On CUDA the
buffer is ordinary host memory page-locked at exactly its size (`cudaHostRegister`,
as torch's own checkpoint stager does), released when the last view is gone; with
`pin=False` (CPU) it is a plain tensor, and everything else is the same code.
"""

from __future__ import annotations

import math
import weakref

import torch

from longstraw.host import host_tensor
from longstraw.plan.offload import arena_offsets


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    """A uint8 [nbytes] CPU tensor; with `pin`, page-locked at exactly `nbytes` (not
    rounded up), and unregistered when its storage is freed. Made through
    `longstraw.host.host_tensor`: a live-bytes tracker counts it as host bytes."""
    return host_tensor(lambda: _buffer(nbytes, pin))


def _buffer(nbytes: int, pin: bool) -> torch.Tensor:
    if not pin or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    import numpy as np

    array = np.empty(nbytes, dtype=np.uint8)  # the tensor's storage holds the array: it dies with the last view
    ptr = array.ctypes.data
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory for the offloaded state failed "
                           f"(cudaError {err}); lower the state's size or the process's locked-memory use")
    done = weakref.finalize(array, _unregister, ptr)
    done.atexit = False  # the process is ending: its registrations go with it
    return torch.from_numpy(array)


def _unregister(ptr: int) -> None:
    """Unpin a buffer about to be freed, after every queued copy (one may still read it)."""
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostArena:
    """Tensors of the given shapes and dtypes as views of one host buffer.

    Args:
        specs: (shape, dtype) per tensor, in layout order.
        pin: page-lock the buffer (CUDA); False on CPU.
        zero: zero the buffer (gradient rows); otherwise uninitialised (rows capture writes).

    Attributes:
        buffer: uint8 [nbytes], the one allocation.
        views: the tensors, views[i] of shape specs[i][0] and dtype specs[i][1].
        offsets: byte offset of each view in `buffer`.
    """

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], *, pin: bool, zero: bool = False):
        sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
        self.offsets, total = arena_offsets(sizes)
        self.buffer = host_buffer(total, pin=pin)
        if zero:
            self.buffer.zero_()
        self.views = [self.buffer[o:o + n].view(dtype).view(shape)
                      for o, n, (shape, dtype) in zip(self.offsets, sizes, specs)]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

