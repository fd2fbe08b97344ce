"""A recurrent layer's prompt state (Gated DeltaNet, Mamba2, KDA): snapshots of its
constant-size state at chosen positions, exact mode's gradients for them, and exact
mode's snapshot offload to host memory (`ExecConfig.offload_snapshots`). Re-exported by
`state/prompt.py` with the other state kinds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.host import host_tensor
from longstraw.tensors import accumulation_dtype, nbytes


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """t copied to host memory (page-locked with `pin`)."""
    out = t.detach().to("cpu", copy=True)
    return out.pin_memory() if pin else out


@dataclass
class RecurrentState:
    """One Gated DeltaNet layer's state at chosen positions (constant size in P).

    A snapshot at position p is the state after every token before p:
        recurrent: [Hv, Dk, Dv], float32 (float64 for float64 models)
        conv_tail: [conv_dim, K - 1], the last K - 1 pre-conv inputs (model dtype)
    (None, None) stands for the zero state at the start of the sequence.

    Fields:
        snapshots: position -> (recurrent, conv_tail).
        keep_all: keep every chunk boundary (exact mode, branch pieces); otherwise
            capture keeps only the latest snapshot.
        grads: when tracking gradients, position -> [dL/d recurrent, dL/d conv_tail]
            accumulated over everything that read that snapshot; None otherwise. The
            walk takes each one (`take_grad`) when it seeds the chunk ending there, so
            at most two positions per layer hold one at a time.
        host: exact mode's snapshot offload (`ExecConfig.offload_snapshots`): every
            snapshot but the latest lives in host memory (`put` moves the previous
            latest there) and `get` stages one back to the device, one at a time.
        h2d_bytes / d2h_bytes: snapshot bytes moved to / from the device since the
            last `reset_moved` (counted on CPU too, as the offload stager counts).
    """

    snapshots: dict = field(default_factory=dict)
    keep_all: bool = False
    grads: dict | None = None
    host: bool = False
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    on_host: set = field(default_factory=set, repr=False)
    staged: tuple | None = field(default=None, repr=False)
    """(position, pair on the device): the snapshot `get` staged last."""

    @classmethod
    def empty(cls, *, start: int, keep_all: bool) -> "RecurrentState":
        """A new state; a sequence start (position 0) holds the zero snapshot."""
        return cls(snapshots={0: (None, None)} if start == 0 else {}, keep_all=keep_all)

    def put(self, position: int, recurrent: torch.Tensor, conv_tail: torch.Tensor) -> None:
        """Record the (detached) snapshot at `position`; drop older ones unless keep_all
        (with `host`, move the previous latest to host memory)."""
        assert recurrent.dim() == 3 and conv_tail.dim() == 2, (recurrent.shape, conv_tail.shape)
        if not self.keep_all:
            self.snapshots.clear()
        elif self.host and self.snapshots:
            self._to_host(max(self.snapshots))
        self.snapshots[position] = (recurrent.detach(), conv_tail.detach())

    def _to_host(self, position: int) -> None:
        pair = self.snapshots[position]
        if pair[0] is None or position in self.on_host:
            return
        pin = torch.cuda.is_available()
        self.snapshots[position] = tuple(host_tensor(lambda t=t: _host_copy(t, pin)) for t in pair)
        self.on_host.add(position)
        self.d2h_bytes += nbytes(*pair)

    def get(self, position: int, device) -> tuple:
        """The snapshot at `position` on `device`: held there (the latest, or without
        `host`), or staged from host memory (the last one staged is reused: a layer's
        recompute in backward reads it again)."""
        pair = self.snapshots[position]
        if position not in self.on_host:
            return pair
        if self.staged is not None and self.staged[0] == position:
            return self.staged[1]
        self.staged = None  # free the previous one first
        staged = tuple(t.to(device, non_blocking=True, copy=True) for t in pair)  # a copy on CPU too, as on CUDA
        self.h2d_bytes += nbytes(*pair)
        self.staged = (position, staged)
        return staged

    def reset_moved(self) -> None:
        """Zero the moved-bytes counters."""
        self.h2d_bytes = self.d2h_bytes = 0

    def add_grad(self, position: int, which: int, grad: torch.Tensor) -> None:
        """Accumulate dL/d snapshot[position][which] (0: recurrent, 1: conv tail)."""
        slot = self.grads.setdefault(position, [None, None])
        grad = grad.detach().to(accumulation_dtype(grad.dtype))  # the sum runs in fp32 for bf16/fp16
        slot[which] = grad.clone() if slot[which] is None else slot[which] + grad

    def take_grad(self, position: int) -> tuple:
        """(dL/d recurrent, dL/d conv tail) accumulated at `position` ((None, None) if
        none), removed from `grads`: the walk seeds the chunk ending there once, and
        nothing adds to it after (everything later has been walked)."""
        return tuple(self.grads.pop(position, (None, None)))

    def enable_grad_buffers(self) -> None:
        self.grads = {}

    def release_grad_buffers(self) -> None:
        self.grads = None
        self.staged = None

    def nbytes(self) -> int:
        return sum(nbytes(*pair) for pair in self.snapshots.values())

    def grad_nbytes(self) -> int:
        return 0 if self.grads is None else sum(nbytes(*pair) for pair in self.grads.values())
