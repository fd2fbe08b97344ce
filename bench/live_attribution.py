"""Which tensors are alive at a call's live-tensor peak, and who allocated them: the CPU
profiler's allocation events (address, size, time) paired alloc to free, replayed in time
order, and the live set at the peak grouped by the innermost longstraw / transformers
(or tests / bench) frame and torch op above each allocation. The diagnostic behind the planner's
context-parallel and expert-parallel terms (`bench/bench_expert_parallel_live.py`,
docs/planner.md); `bench.live_peak` is the cheap peak alone.

    from bench.live_attribution import live_at_peak
    peak, rows = live_at_peak(fn)   # rows: [(bytes, label)], largest first
"""

from __future__ import annotations

from collections import defaultdict

_MINE = ("longstraw/", "transformers/", "tests/", "bench/")


def _label(chain: list[str]) -> str:
    """The innermost project frame (file:function) and the innermost op of an allocation's
    parent chain (outermost first)."""
    frames = [n for n in chain if any(m in n for m in _MINE)]
    ops = [n for n in chain if n.startswith(("aten::", "autograd::")) or "Backward" in n]
    where = frames[-1].split("site-packages/")[-1] if frames else "(no python frame)"
    return f"{where} | {ops[-1] if ops else '-'}"


def live_at_peak(fn) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes, [(bytes, label)] of the allocations alive at the peak, largest first)
    of torch CPU tensors allocated during fn() (tensors that existed before are not
    counted, as in `bench.live_peak.live_tensor_peak`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        fn()
    events = []  # (time, ptr, bytes, chain)

    def walk(node, chain):
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            ef = node.extra_fields
            events.append((node.start_time_ns, ef.ptr, ef.alloc_size, chain))
            return
        chain = chain + [node.name]
        for child in node.children:
            walk(child, chain)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    events.sort(key=lambda e: e[0])
    live, total, peak, at_peak = {}, 0, 0, {}
    for _, ptr, nbytes, chain in events:
        if nbytes > 0:
            live[ptr] = (nbytes, chain)
        elif ptr in live:
            live.pop(ptr)
        else:
            continue  # freed here, allocated before fn()
        total += nbytes
        if total > peak:
            peak, at_peak = total, dict(live)
    groups = defaultdict(int)
    for nbytes, chain in at_peak.values():
        groups[_label(chain)] += nbytes
    return peak, sorted(((v, k) for k, v in groups.items()), reverse=True)
