"""Memory figures the library reports (`longstraw demo`, the TRL trainer's logs): this
process's RSS and its peak, and the graph bytes per token of the naive full-sequence path
(the activation bytes one HF forward saves for backward, measured at two short lengths
instead of run at full length).

Benchmark-only measurements (the live-tensor peak from the profiler) live in `bench/`."""

from __future__ import annotations

import contextlib
import logging
import resource
import sys

import torch


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; 0 if unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def saved_activation_bytes(fn) -> int:
    """Bytes of distinct storages that autograd saves for backward while running fn().

    Parameters (leaves that require grad) are excluded: they are held anyway.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if not (t.is_leaf and t.requires_grad):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def naive_bytes_per_token(model, vocab_size: int, lengths=(256, 512)) -> float:
    """Slope of the saved-activation bytes of one full-sequence HF forward (with grad),
    measured at two lengths: the naive path's graph memory per token."""
    sizes = []
    with without_hf_kernel_fallback_warning():
        for n in lengths:
            ids = torch.randint(0, vocab_size, (1, n), device=next(model.parameters()).device)
            sizes.append(saved_activation_bytes(lambda: model(ids, logits_to_keep=1).logits.sum()))
    return (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])


class _KernelFallbackFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


@contextlib.contextmanager
def without_hf_kernel_fallback_warning():
    """Drop transformers' "`chunk_gated_delta_rule` / `causal_conv1d_fn` is falling back to
    its reference PyTorch implementation because flash-linear-attention / causal_conv1d is
    not installed" while the naive estimate runs HF's own GDN forward. It does not apply:
    LongStraw's own steps never call those HF functions (ops/gated_delta.py and
    ops/causal_conv.py are its kernels), and the estimate only counts the bytes HF's
    forward saves, which the fallback does not change. Other messages pass."""
    hf_logger = logging.getLogger("transformers.integrations.hub_kernels")
    quiet = _KernelFallbackFilter()
    hf_logger.addFilter(quiet)
    try:
        yield
    finally:
        hf_logger.removeFilter(quiet)
