"""The peak of live torch tensors during a call, from the profiler's allocation events:
the CPU analogue of `torch.cuda.max_memory_allocated`, blind to allocator and runtime
slack. Used by the benchmarks and by tests/test_plan_live.py (the library does not need
it, so it lives here, not in `longstraw`).

Under gloo, `settle=True`. The profiler records an allocation or a free only on the thread
that runs the profiler, and gloo runs every collective on its worker threads: a tensor
whose last reference is a collective's `Work` (FSDP2's all-gather output and
reduce-scatter input, whose owner lets them go while the worker still holds them), and
the staging copies gloo makes of a reduce-scatter's input, are freed there, unseen, and
stay "live" to the end of the call. Measured on two gloo ranks
(bench/fsdp2_fit_attribution.py): 25-50% of the collectives' frees were lost, and the
FSDP2 step read 1.3-2.6x its true peak. `settle` runs the call with every collective of
`torch.distributed` made synchronous and held until gloo's worker has let its tensors go
(`settled_collectives`), and leaves out what gloo allocates inside a collective (its
staging copies, which NCCL does not make): the step's own tensors, as on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "broadcast", "all_to_all_single")
"""`torch.distributed` functions `settled_collectives` wraps: the ones every rank calls in the
same order (so waiting for each at once cannot deadlock; point-to-point sends are left alone)."""

SETTLED = "settled::"
"""The prefix of the profiler range around a settled collective."""


def _tensors(args, kwargs) -> list:
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _settled(name: str, collective, timeout_s: float = 5.0):
    @functools.wraps(collective)
    def run(*args, **kwargs):
        tensors = _tensors(args, kwargs)
        before = [t._use_count() for t in tensors]
        with torch.profiler.record_function(SETTLED + name):
            work = collective(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()
            start = time.monotonic()  # the worker thread drops its Work (and our tensors) after completing it
            while any(t._use_count() > n for t, n in zip(tensors, before)):
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"{name}: gloo's worker held its tensors for more than {timeout_s} s")
                time.sleep(0)
        return work
    return run


@contextlib.contextmanager
def settled_collectives():
    """Within the block, every `COLLECTIVES` function of `torch.distributed` runs to completion
    in the call and returns only once the backend's worker has let its tensors go (an async
    one returns its completed `Work`), inside a profiler range `SETTLED + name`."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, _settled(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def allocation_events(prof) -> list[tuple[int, int, int, list, int]]:
    """(time ns, ptr, bytes (< 0: a free), op chain outermost first, allocation id) of a
    profile's CPU allocation events, in time order. An allocation made inside a settled
    collective's range (gloo's own staging: the copy its reduce-scatter makes of the input,
    its all-gather's buffer; NCCL works in place on the caller's tensors, and gloo frees
    these on its worker, unseen) gets a free at once, id -(its id): not counted."""
    events, ids = [], [0]

    def walk(node, chain, inside):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            ef = node.extra_fields
            ids[0] += 1
            events.append((node.start_time_ns, ef.ptr, ef.alloc_size, chain, ids[0]))
            if inside and ef.alloc_size > 0:
                events.append((node.start_time_ns, ef.ptr, -ef.alloc_size, chain, -ids[0]))
            return
        inside = inside or node.name.startswith(SETTLED)
        chain = chain + [node.name]
        for child in node.children:
            walk(child, chain, inside)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [], False)
    events.sort(key=lambda e: e[0])  # stable: a settled free right after its allocation
    return events


def replay_live(events):
    """Replay `allocation_events` in time order: yields (live bytes, {ptr: (bytes, chain, id)})
    after each event. A free of a tensor that existed before fn() counts (the call's net
    bytes, as `live_tensor_peak` has always counted); a settled free is applied only to the
    allocation it belongs to, and the real free of one it applied to is then not counted again."""
    live, settled, total = {}, set(), 0
    for _, ptr, nbytes, chain, ident in events:
        if nbytes > 0:
            live[ptr] = (nbytes, chain, ident)
            settled.discard(ptr)
        elif ident < 0:  # a settled free
            if ptr not in live or live[ptr][2] != -ident:
                continue
            nbytes = -live.pop(ptr)[0]
            settled.add(ptr)
        elif ptr in live:
            nbytes = -live.pop(ptr)[0]
        elif ptr in settled:
            settled.discard(ptr)
            continue
        total += nbytes
        yield total, live


def live_tensor_peak(fn, *, settle: bool = False) -> int:
    """Peak bytes of torch CPU tensors allocated during fn() and alive at once (tensors
    that existed before are not counted). `settle`: under `settled_collectives` (gloo)."""
    from torch.profiler import ProfilerActivity, profile

    if settle:
        with settled_collectives(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return max((total for total, _ in replay_live(allocation_events(prof))), default=0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak
