"""Memory measurement helpers: process RSS, its peak, the peak of live torch tensors,
and the activation bytes an autograd graph saves (used to size the naive full-sequence
path without running it at full length)."""

from __future__ import annotations

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


def live_tensor_peak(fn) -> int:
    """Peak bytes of torch CPU tensors allocated during fn() and alive at once (tensors
    that existed before are not counted), from the profiler's allocation events: the CPU
    analogue of `torch.cuda.max_memory_allocated`, blind to allocator and runtime slack."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


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
    for n in lengths:
        ids = torch.randint(0, vocab_size, (1, n), device=next(model.parameters()).device)
        sizes.append(saved_activation_bytes(lambda: model(ids, logits_to_keep=1).logits.sum()))
    return (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])
