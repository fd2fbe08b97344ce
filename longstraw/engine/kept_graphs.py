"""Exact mode without recomputation where memory allows: keep capture chunks' graphs.

The reverse walk recomputes each capture chunk with autograd to push the prompt-state
gradient through it. When memory allows, capture can instead run a chunk with autograd
on and KEEP its graph; the walk then backpropagates through the kept graph directly.
With every chunk kept, exact mode is one forward and one backward of the prompt plus the
branches: no recomputation.

`ExecConfig.keep_graph_bytes` is the budget for the kept graphs (only they: not the
state, the weights or a branch's graph). The engine measures one chunk's graph as the
bytes autograd saves for it (`SavedBytes`: the storages packed by
`torch.autograd.graph.saved_tensors_hooks`, each counted once, the parameters
excluded), then keeps the graphs of as many of the LAST chunks as fit: the walk reaches
them first, so they are freed before any chunk has to be recomputed, and the walk's peak
is the larger of the kept graphs and one recomputed chunk, never their sum.
"""

from __future__ import annotations

import torch


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward inside the block,
    parameters excluded (they are held anyway).

    The pack hook returns the tensor DETACHED (same storage, no `grad_fn`): an op that
    saves its own output (rsqrt, mul, ...) would otherwise hold that output, whose
    `grad_fn` holds the saved copy, a cycle through the C++ graph that neither
    refcounting nor `gc` frees, and an unkept measured graph would outlive its step
    (issue 43, item 1). Backward only needs the values, so the gradients are the same."""

    def __init__(self, model: torch.nn.Module):
        self.exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. a tensor subclass without storage
            return tensor
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += storage.nbytes()
        return tensor.detach()

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def chunks_to_keep(starts: list[int], chunk_graph_bytes: int, budget: int) -> set[int]:
    """The starts of the last chunks whose graphs fit in `budget` bytes at
    `chunk_graph_bytes` each (the first chunk's measured graph)."""
    fit = len(starts) if chunk_graph_bytes <= 0 else min(len(starts), budget // chunk_graph_bytes)
    return set(starts[len(starts) - fit:]) if fit > 0 else set()
