"""Rehearsals: the engine's own step at full size on fake tensors (`run.rehearse`),
measured by a live-bytes tracker (`tracker.LiveBytes`) that counts real runs the same way."""

from longstraw.rehearsal.run import Rehearsal, rehearse
from longstraw.rehearsal.tracker import LiveBytes

__all__ = ["LiveBytes", "Rehearsal", "rehearse"]
