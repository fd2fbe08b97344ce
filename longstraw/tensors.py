"""Small types and dtype rules shared by the kernels (`ops/`) and the state (`state/`).

Both rooms sit at the bottom of the package (engine -> models -> ops/state); neither
imports the other. What they must agree on lives here:

* `accumulation_dtype`: the dtype sums run in (softmax statistics, gradient buffers).
* `nbytes`: the bytes tensors hold (states' `nbytes()`, traffic and staging counters).
* `KVSegment`: a run of earlier keys/values, as the state hands it to attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulation_dtype_of(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype a computation over `tensors` accumulates in: float64 when any of them
    (None skipped) is float64, else float32 (`accumulation_dtype` of each, joined)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the elements of `tensors` (numel * element size, summed; None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class KVSegment:
    """A run of earlier keys/values the new tokens attend to (read-only).

    Fields:
        k: [Hkv, S, D]; v: [Hkv, S, Dv] at absolute positions start .. start + S - 1.
        grad: optional (dk, dv) buffers of the same shapes (in the accumulation dtype);
            backward adds dLoss/dk, dLoss/dv into them (exact mode, and branch pieces).
        cp: a `parallel.context.ContextParallel` when k, v are this rank's rows of a
            position-sharded state; None when they are the whole segment.
        positions: LongTensor [S], the rows' absolute positions where they are not
            start .. start + S - 1 (a sharded sliding-window layer's rows, which the
            window masks by position); None: consecutive from `start`.
    """

    k: torch.Tensor
    v: torch.Tensor
    start: int
    grad: tuple | None = None
    cp: object = None
    positions: torch.Tensor | None = None

    @property
    def key_start(self):
        """What the blockwise kernel takes as the keys' positions (`PrefixAttention`'s
        k_start): the rows' positions [S] when set, else the int `start`."""
        return self.start if self.positions is None else self.positions
