"""One step measured phase by phase: the same function for a real run and a rehearsal.

`measure_steps` installs an `Engine.phase_hook` that opens the tracker's phase (capture,
replay, walk) around each phase of `Engine.step` (the tracker counts its bytes and FLOPs), runs the steps (and
an optimizer step per step when given one), and returns per step the peak live bytes,
the per-phase peaks, the FLOPs per phase and the host syncs (`longstraw.host.HostSyncs`).
The tests run it on a real tiny model and on its fake twin and compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longstraw.host import HostSyncs
from longstraw.rehearsal.tracker import LiveBytes


@dataclass(kw_only=True, slots=True)
class StepFigures:
    """What one measured step gave."""

    peak_bytes: int
    """Highest live bytes on the tracked device during the step (optimizer step included)."""
    phases: dict[str, int] = field(default_factory=dict)
    """Peak live bytes per phase: capture, replay, walk (exact mode), optimizer (if given)."""
    flops: dict[str, int] = field(default_factory=dict)
    """FLOPs per phase (`torch.utils.flop_counter`'s formulas: matmuls, attention)."""
    host_syncs: int = 0
    """Reads of device data during the step (`longstraw.host.to_host`)."""
    ops: int = 0
    """Ops the tracker saw during the step (on fake tensors: what a rehearsal's time goes into)."""


def measure_steps(engine, group, grpo, *, steps: int = 1, tracker: LiveBytes, optimizer=None) -> list[StepFigures]:
    """Run `steps` x `engine.step(group, grpo)` under `tracker` (already adopted the
    weights); after each, `optimizer.step()` (phase "optimizer") if given, then the
    gradients are set to None, as a training loop's `zero_grad()` does."""
    out = []
    hook = tracker.phase
    before, engine.phase_hook = engine.phase_hook, hook
    try:
        for _ in range(steps):
            tracker.peak, tracker.phase_peaks, tracker.phase_flops, tracker.ops = tracker.live, {}, {}, 0
            HostSyncs.count = 0
            with tracker:
                engine.step(group, grpo)
                if optimizer is not None:
                    with hook("optimizer"):
                        optimizer.step()
            syncs = HostSyncs.count
            engine.model.zero_grad(set_to_none=True)
            out.append(StepFigures(peak_bytes=tracker.peak, phases=dict(tracker.phase_peaks), flops=dict(tracker.phase_flops),
                                   host_syncs=syncs, ops=tracker.ops))
    finally:
        engine.phase_hook = before
    return out
