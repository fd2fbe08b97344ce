"""The peak of live torch tensors during a call, from the profiler's allocation events:
the CPU analogue of `torch.cuda.max_memory_allocated`, blind to allocator and runtime
slack. Used by the benchmarks and by tests/test_plan_live.py (the library does not need
it, so it lives here, not in `longstraw`)."""

from __future__ import annotations


def live_tensor_peak(fn) -> int:
    """Peak bytes of torch CPU tensors allocated during fn() and alive at once (tensors
    that existed before are not counted)."""
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
