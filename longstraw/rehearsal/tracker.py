"""Live bytes per phase, counted the same way on real and on fake tensors.

`LiveBytes` is a `TorchDispatchMode`: every tensor an op returns (on the tracked device
type) has its storage registered once, by a weak reference whose finalizer takes its
bytes off the live total when the storage dies (a storage resized in place, as FSDP2
frees and re-gathers its parameters, is counted at its new size). Parameters, buffers and anything
allocated before the tracker started are counted through `LiveBytes.adopt` (the
rehearsal adopts the model's parameters). `phase(name)` records the highest live total
seen while it is open, so a step's capture, replay, walk and optimizer peaks come out of
one run, and `phase_flops` the FLOPs of its ops (`torch.utils.flop_counter`'s formulas:
matmuls, convolutions, attention; counted here rather than by `FlopCounterMode`, whose
module hooks trip on the engine's no-grad capture). Fake tensors carry their storage sizes, so the same count runs on a rehearsal
without data (`longstraw.rehearsal.run`).

Why not `torch.distributed._tools.MemTracker`: it refuses a module called more than once
per step, and the engine calls every layer once per chunk.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils._pytree import tree_leaves

from longstraw.host import HostMemory
from longstraw.ops.workspace import WORKSPACE


_PRIM_DEVICE = torch.ops.prim.device.default


def _storage_key(t: torch.Tensor):
    """The identity of t's storage (fake storages have no data pointer; their Python
    object is unique while alive)."""
    return t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Counts live storage bytes on `device_type` ("cuda", "cpu"); see the module docstring.

    Attributes:
        live: bytes alive now.  peak: the highest `live` since start.
        phase_peaks: {phase name: highest `live` while that phase was open}.
        phase_flops: {phase name: FLOPs of the ops run while it was open}.
        ops: ops dispatched (prim metadata queries and profiler records not counted): a rehearsal's cost.
        host_live, host_peak, host_phase_peaks: the same of host memory, counted apart:
            the tensors made through `longstraw.host.host_tensor` (offloaded snapshots,
            state offload's arenas), on the CPU branches too, where host and device are one.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._dynamo wrapper around __torch_dispatch__: nothing is compiled under a tracker,
        # and C++ asks a fake tensor's device (prim.device) through this mode about twice an op

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.ops = 0
        self.peak = 0
        self.phase_peaks: dict[str, int] = {}
        self.phase_flops: dict[str, int] = {}
        self.host_live = 0
        self.host_peak = 0
        self.host_phase_peaks: dict[str, int] = {}
        self._open: list[str] = []
        self._host_depth = 0  # > 0 inside `host_block`: the CPU storages made are host memory
        self._seen: dict[int, weakref.ref] = {}  # id(storage) -> weakref (finalizers also keyed on it)
        self._bytes: dict[int, int] = {}  # id(storage) -> the bytes counted for it
        self._host: set[int] = set()  # id(storage) of those counted as host bytes

    # --------------------------------------------------------------------------
    def _register(self, t: torch.Tensor) -> None:
        host = self._host_depth > 0 and t.device.type == "cpu"
        if t.device.type != self.device_type and not host:
            return
        try:
            storage = _storage_key(t)
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        self._count(storage, host)

    def _count(self, storage, host: bool = False) -> None:
        key = id(storage)
        ref = self._seen.get(key)
        if ref is not None and ref() is not None:
            return
        try:
            self._seen[key] = weakref.ref(storage, lambda _, k=key: self._free(k))
        except TypeError:
            return
        self._bytes[key] = nbytes = int(storage.nbytes())
        if host:
            self._host.add(key)
            self.host_live += nbytes
        else:
            self.live += nbytes
        self._bump()

    def _free(self, key: int) -> None:
        self._seen.pop(key, None)
        if key in self._host:
            self._host.discard(key)
            self.host_live -= self._bytes.pop(key, 0)
        else:
            self.live -= self._bytes.pop(key, 0)

    @contextlib.contextmanager
    def host_block(self):
        """The CPU storages made in the block are host memory (`longstraw.host.host_tensor`)."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def count_host(self, t: torch.Tensor) -> None:
        """Count t's storage as host bytes (made where no op showed it: `torch.from_numpy`)."""
        with self.host_block():
            self._register(t)

    def _resized(self, storage) -> None:
        """A storage resized in place (FSDP2 frees and re-allocates its gathered
        parameters so: `storage.resize_(0)`, `resize_(n)`): its bytes now. A storage
        already counted is followed whatever its device says (a fake tensor's storage is
        on `meta`, not on the fake device: tested by the device, FSDP2's frees on a
        rehearsal went unseen); one not yet counted, only on the tracked device."""
        key = id(storage)
        ref = self._seen.get(key)
        if ref is None or ref() is None:
            if storage.device.type == self.device_type:
                self._count(storage)
            return
        if key in self._host:
            return
        nbytes = int(storage.nbytes())
        self.live += nbytes - self._bytes[key]
        self._bytes[key] = nbytes
        self._bump()

    def __enter__(self):
        tracker, resize = self, torch.UntypedStorage.resize_

        def resize_(storage, size):  # not a tensor op: no dispatch mode sees it
            out = resize(storage, size)
            tracker._resized(storage)
            return out

        self._resize, torch.UntypedStorage.resize_ = resize, resize_
        HostMemory.trackers.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        HostMemory.trackers.remove(self)
        return super().__exit__(*exc)

    def _bump(self, live: int | None = None) -> None:
        live = self.live if live is None else live
        if live > self.peak:
            self.peak = live
        self.host_peak = max(self.host_peak, self.host_live)
        for name in self._open:
            if live > self.phase_peaks.get(name, 0):
                self.phase_peaks[name] = live
            if self.host_live > self.host_phase_peaks.get(name, 0):
                self.host_phase_peaks[name] = self.host_live

    def adopt(self, tensors) -> None:
        """Count tensors allocated before the tracker started (parameters, a held state);
        a DTensor (an FSDP2 shard) by its local tensor's storage."""
        for t in tensors:
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor):
                self._register(t)

    @property
    def current_phase(self) -> str | None:
        """The innermost phase open now (None between phases); safe to read from another thread."""
        open_ = self._open
        return open_[-1] if open_ else None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the peak of live bytes while the block runs as `phase_peaks[name]`
        (at least the live bytes at its start)."""
        self._open.append(name)
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.live)
        self.host_phase_peaks[name] = max(self.host_phase_peaks.get(name, 0), self.host_live)
        try:
            yield
        finally:
            self._open.remove(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
            return args[0].fake_device  # what FakeTensorMode answers, without its dispatch (C++ asks this often)
        if func.namespace == "profiler":  # record_function's enter / exit (FSDP2, autograd): no tensor in or out
            with torch._C._DisableTorchDispatch():  # so no mode below needs them: ~15 us, not ~85 through the fake mode
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # prim.device / prim.layout: metadata queries, no tensor made
            return out
        self.ops += 1
        workspace = WORKSPACE.get(func)
        if workspace is not None:  # a registered op's temporaries, alive while it ran (`ops/workspace.py`)
            self._bump(self.live + workspace(*args, **(kwargs or {})))
        count = flop_registry.get(func._overloadpacket) if self._open else None
        if count is not None:
            flops = int(count(*args, **(kwargs or {}), out_val=out))
            for name in self._open:
                self.phase_flops[name] = self.phase_flops.get(name, 0) + flops
        if isinstance(out, torch.Tensor):  # most ops: one tensor (tree_leaves' pytree walk costs more)
            self._register(out)
        elif out is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._register(t)
        return out
