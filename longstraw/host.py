"""The one seam where a step reads data back to the host.

On a GPU every read of device data (`.item()`, `int(t)`, `.tolist()`, data-dependent
control flow) is a device sync. The engine routes such reads through `to_host`, which
counts them (`HostSyncs`), and runs its checks of the small real inputs (token ids,
rewards, masks, advantages) under `on_host()`. A rehearsal (`longstraw.rehearsal`) runs
the model, state and activations as fake tensors (shapes without data): there `on_host()`
steps outside the fake mode so the real inputs are checked for real, and `to_host` of a
fake tensor returns a stand-in of the right kind (0, False, a list of zeros) instead of
raising.

Host memory is the other seam: every tensor a step places in host memory (exact mode's
offloaded recurrent snapshots, `state/recurrent.py`; state offload's host arenas,
`state/host_arena.py`) is made by `host_tensor`, which tells each active live-bytes
tracker (`rehearsal.tracker.LiveBytes`, listed in `HostMemory.trackers`) to count it as
host bytes, not device bytes. On the CPU branches host and device are one memory, so
without this seam an offloaded row would count as a device byte, on real and fake
tensors alike.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


class HostSyncs:
    """Reads of device data so far in this process (`to_host` calls on tensors off the CPU
    or fake). `count` is reset by whoever measures (a rehearsal, per step)."""

    count = 0


class HostMemory:
    """The live-bytes trackers active now (`LiveBytes` adds itself while entered): each
    has `host_block()`, a context in which the tensors it sees made are host memory,
    and `count_host(t)`, which counts `t`'s storage as host bytes."""

    trackers: list = []


def host_tensor(make):
    """`make()`, a CPU tensor in host memory (a copy to host, a host buffer), counted by
    every active tracker as host bytes: whatever `make` allocates on the CPU, and the
    result even where no op made it (`torch.from_numpy`)."""
    with contextlib.ExitStack() as stack:
        for tracker in HostMemory.trackers:
            stack.enter_context(tracker.host_block())
        out = make()
        for tracker in HostMemory.trackers:
            tracker.count_host(out)
    return out


def _faking() -> bool:
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def on_host():
    """Run the block on real tensors even inside a rehearsal's fake mode (checks of the
    small real inputs: token ids, rewards, masks)."""
    if _faking():
        with unset_fake_temporarily():
            yield
    else:
        yield


def to_host(t: torch.Tensor, kind=float, stand_in=None):
    """t's value on the host as `kind` (float, int, bool, list or bytes: its raw bytes),
    counted as one host sync when t is on a device or fake. A fake tensor gives a
    stand-in: `stand_in` where the caller gives one (what a rehearsal should assume where
    the value steers the work, e.g. how many queries take rows of a piece), else 0
    (False), a list of zeros of t's length, or zero bytes of its size."""
    if not isinstance(t, torch.Tensor):
        return kind(t)
    fake = is_fake(t)
    if fake or t.device.type != "cpu":
        HostSyncs.count += 1
    if fake:
        if stand_in is not None:
            return stand_in
        return [0] * t.numel() if kind is list else bytes(t.numel() * t.element_size()) if kind is bytes else kind(0)
    if kind is bytes:
        return t.detach().cpu().numpy().tobytes()
    return t.tolist() if kind is list else kind(t.item() if t.numel() == 1 else t)
