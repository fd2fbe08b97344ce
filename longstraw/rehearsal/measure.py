"""One step measured phase by phase: the same function for a real run and a rehearsal.

`measure_steps` installs an `Engine.phase_hook` that opens the tracker's phase (capture,
replay, walk) around each phase of `Engine.step` (the tracker counts its bytes and FLOPs), runs the steps (and
an optimizer step per step when given one), and returns per step the peak live bytes,
the per-phase peaks (of the device, and apart of host memory), the FLOPs per phase, the host syncs (`longstraw.host.HostSyncs`) and,
under context parallelism, the bytes each collective brought this rank per phase (read
from the engine's own counter, `parallel.collectives.Traffic.by_collective`, around the
same phases; "gradients" is the rest of the step: replicated gradients made the first
rank's). The tests run it on a real tiny model and on its fake twin and compare.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from longstraw.host import HostSyncs
from longstraw.parallel.collectives import Traffic
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
    comm_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """{phase: {collective: bytes this rank received}} (`Traffic`'s model); {} in one process."""
    host_peak_bytes: int = 0
    """Highest live host bytes during the step (`longstraw.host.host_tensor`: offloaded
    snapshots, state offload's arenas), not among `peak_bytes` (on the CPU branches too)."""
    host_phases: dict[str, int] = field(default_factory=dict)
    """Peak live host bytes per phase."""
    metrics: dict = field(default_factory=dict)
    """The step's own metrics (`StepResult.metrics`: `comm_bytes_capture`, ... among them)."""


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _hooks(tracker: LiveBytes, comm: dict, marks: dict, on_phase=None):
    """The phase hook: the tracker's phase, and the collectives' bytes of the phase into
    `comm` (those before the first phase of a step, from `marks["start"]` on, as "validation");
    `on_phase(name, ops)` after each phase, if given (ops: the step's so far)."""
    @contextlib.contextmanager
    def hook(name: str):
        before = dict(Traffic.by_collective)
        if "start" in marks:  # the step's first phase: what came before is validation's
            comm["validation"] = _delta(before, marks.pop("start"))
        with tracker.phase(name):
            try:
                yield
            finally:
                for k, v in _delta(Traffic.by_collective, before).items():
                    comm.setdefault(name, {})[k] = comm.get(name, {}).get(k, 0) + v
        if on_phase is not None:
            on_phase(name, tracker.ops)
    return hook


def measure_steps(engine, group, grpo, *, steps: int = 1, tracker: LiveBytes, optimizer=None,
                  on_phase=None) -> list[StepFigures]:
    """Run `steps` x `engine.step(group, grpo)` under `tracker` (already adopted the
    weights); after each, `optimizer.step()` (phase "optimizer") if given, then the
    gradients are set to None, as a training loop's `zero_grad()` does. `on_phase(step,
    name, ops)`: called as each phase ends (a long rehearsal's progress)."""
    out = []
    comm: dict[str, dict[str, int]] = {}
    marks: dict[str, dict[str, int]] = {}
    report = None if on_phase is None else (lambda name, ops: on_phase(len(out), name, ops))  # len(out): this step
    hook = _hooks(tracker, comm, marks, report)
    before, engine.phase_hook = engine.phase_hook, hook
    try:
        for _ in range(steps):
            tracker.peak, tracker.phase_peaks, tracker.phase_flops, tracker.ops = tracker.live, {}, {}, 0
            tracker.host_peak, tracker.host_phase_peaks = tracker.host_live, {}
            HostSyncs.count = 0
            comm.clear()
            start = marks["start"] = dict(Traffic.by_collective)
            with tracker:
                metrics = engine.step(group, grpo).metrics
                rest = _delta(Traffic.by_collective, start)  # the step's bytes, less its phases' and validation's
                for phase in comm.values():
                    rest = {k: v - phase.get(k, 0) for k, v in rest.items() if v != phase.get(k, 0)}
                gradients = comm.setdefault("gradients", {})  # its own phase's (the W > 1 broadcast) and the rest
                for k, v in rest.items():
                    gradients[k] = gradients.get(k, 0) + v
                if optimizer is not None:
                    with hook("optimizer"):
                        optimizer.step()
            syncs = HostSyncs.count
            engine.model.zero_grad(set_to_none=True)
            out.append(StepFigures(peak_bytes=tracker.peak, phases=dict(tracker.phase_peaks), flops=dict(tracker.phase_flops),
                                   host_syncs=syncs, ops=tracker.ops, comm_bytes={k: dict(v) for k, v in comm.items() if v},
                                   host_peak_bytes=tracker.host_peak, host_phases=dict(tracker.host_phase_peaks),
                                   metrics=metrics))
    finally:
        engine.phase_hook = before
    return out
