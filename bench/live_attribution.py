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

import contextlib
from collections import defaultdict

_MINE = ("longstraw/", "transformers/", "tests/", "bench/", "torch/distributed/fsdp/")


def _label(chain: list[str]) -> str:
    """The innermost project (or FSDP2) frame (file:function) and the innermost op of an
    allocation's parent chain (outermost first)."""
    frames = [n for n in chain if any(m in n for m in _MINE)]
    ops = [n for n in chain if n.startswith(("aten::", "autograd::")) or "Backward" in n]
    where = frames[-1].split("site-packages/")[-1] if frames else "(no python frame)"
    return f"{where} | {ops[-1] if ops else '-'}"


def live_at_peak(fn, *, settle: bool = False, label=_label, stack: bool = True) -> tuple[int, list[tuple[int, str]]]:
    """(peak bytes, [(bytes, label)] of the allocations alive at the peak, largest first)
    of torch CPU tensors allocated during fn() (tensors that existed before are not
    counted, as in `bench.live_peak.live_tensor_peak`; `settle` as there: under gloo).
    `label(chain)`: the group of an allocation, from its op / frame chain (outermost first);
    `stack=False`: ops and profiler ranges only (cheaper; under gloo the Python tracer was
    seen to lose frees that the plain profile keeps)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.live_peak import allocation_events, replay_live, settled_collectives

    with (settled_collectives() if settle else contextlib.nullcontext()), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=stack) as prof:
        fn()
    peak, at_peak = 0, {}
    for total, live in replay_live(allocation_events(prof)):
        if total > peak:
            peak, at_peak = total, dict(live)
    groups = defaultdict(int)
    for nbytes, chain, _ in at_peak.values():
        groups[label(chain)] += nbytes
    return peak, sorted(((v, k) for k, v in groups.items()), reverse=True)
