"""The bytes a registered op holds inside itself: `WORKSPACE`.

A registered op (`torch.library.custom_op`) is one op to anything that watches ops: the
live-byte tracker (`longstraw.rehearsal.tracker.LiveBytes`) sees its outputs, never the
temporaries its implementation makes and frees. Where those are known, the op's module
declares them here, and the tracker counts them for the op's duration (at the live
bytes before the op plus the workspace), on real and fake tensors alike.
"""

from __future__ import annotations

from collections.abc import Callable

WORKSPACE: dict[object, Callable[..., int]] = {}
"""{op overload: fn(*args, **kwargs) -> bytes}: the most bytes the op holds at once in
temporaries that it frees before it returns."""


def declare_workspace(op, fn: Callable[..., int]) -> None:
    """Declare `fn(*args, **kwargs) -> bytes` as the temporaries of `op` (an `OpOverload`)."""
    WORKSPACE[op] = fn
