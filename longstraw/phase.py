"""The phase of a run: what the model's routed mixers do with the new tokens' state.

Below every layer (torch-free, imports nothing): the engine and the context-parallel
driver pass a `Phase`, the models switch on it (`models/routing.py` tells what each
phase does).
"""

from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    """What a run does with the new tokens' state (see the module docstring). A str
    enum: `Phase("capture")` converts, and a phase equals its name as a string."""

    CAPTURE = "capture"
    REPLAY = "replay"
    RECOMPUTE = "recompute"
    DECODE = "decode"
    DIVIDED = "divided"
