"""Starting the default process group so that an elastic restart can start it again, and
collectives that end: the one place every launch path we ship initializes torch.distributed
(`examples/torchrun_grpo.py`, `longstraw train` / `demo` under torchrun, and
`LongStrawGRPOTrainer`, whose script calls `init_distributed()` before it builds its
`GRPOConfig`: accelerate then reuses the group).

Why not plain `init_process_group()` (env://). Under `torchrun --max-restarts N` every
worker is a client of the elastic agent's TCPStore (TORCHELASTIC_USE_AGENT_STORE=True: the
c10d rendezvous of `--standalone` and `--rdzv-backend c10d` across nodes, and the static
one of `--master-addr/--master-port`; `accelerate launch` runs torchrun's launcher), and
that store lives across restarts. env:// keys the default group under the same names on
every attempt, so a restarted rank can read the killed rank's old address ("Gloo
connectFullMesh failed ... Connection refused") and the group hangs in
`_new_process_group_helper`: a race, 3 of 8 tries failed or hung here, 0 of 8 with the
prefix (bench/results/elastic_repro.csv).
Here the group is initialized on `PrefixStore("longstraw/attempt_<TORCHELASTIC_RESTART_COUNT>",
<a client of that store>)`: each attempt has its own keys. Without an agent's store (ranks
started by hand or by `mp.spawn` with MASTER_ADDR/MASTER_PORT set) env:// is right and is
used.

Timeouts. A collective waits at most `collective_timeout()` (LONGSTRAW_COLLECTIVE_TIMEOUT
seconds, default 600), not the process group's 30 minutes: it is passed to
`init_process_group` and to every `new_group` of `parallel.mesh`, so gloo raises in the
waiting rank. `phase(name)` turns that error into a `DistributedError` naming this rank,
the phase and the timeout, and arms a watchdog thread that watches progress, not the
phase's length: a phase may run as long as it needs while its collectives complete
(`longstraw.heartbeat`: every LongStraw collective, every run of the decoder stack, every
item of the engine's loops beats); when no beat came for twice the timeout (a collective
that never returns, a stuck kernel) it prints the rank, the phase and the silence, and
ends the process (exit code 70), so torchrun sees a failure instead of a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from longstraw.errors import DistributedError, LongStrawError
from longstraw.heartbeat import last_beat

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""Seconds a collective may wait for its peers (LONGSTRAW_COLLECTIVE_TIMEOUT overrides)."""
WATCHDOG_EXIT_CODE = 70


def collective_timeout() -> datetime.timedelta:
    """The stated timeout of every collective: LONGSTRAW_COLLECTIVE_TIMEOUT seconds (a
    float), default `DEFAULT_COLLECTIVE_TIMEOUT_S`."""
    raw = os.environ.get("LONGSTRAW_COLLECTIVE_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_COLLECTIVE_TIMEOUT_S
    except ValueError:
        raise DistributedError(f"LONGSTRAW_COLLECTIVE_TIMEOUT={raw!r} is not a number of seconds; "
                               "set it to e.g. 600") from None
    if seconds <= 0:
        raise DistributedError(f"LONGSTRAW_COLLECTIVE_TIMEOUT={raw!r} must be > 0 seconds")
    return datetime.timedelta(seconds=seconds)


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0 on the first attempt and
    outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _attempt_store(timeout: datetime.timedelta):
    """A PrefixStore of this attempt on a client of the elastic agent's TCPStore, or None
    when the agent shares no store (then env:// makes a fresh one per attempt)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"longstraw/attempt_{restart_count()}", client)


def init_distributed(backend: str | None = None) -> tuple[int | None, torch.device]:
    """Initialize the default process group for this launch; returns (rank, device).

    Under torchrun / accelerate launch (WORLD_SIZE > 1): NCCL on cuda:LOCAL_RANK where CUDA
    is available, else gloo on CPU; on this attempt's store (module docstring) with
    `collective_timeout()`. Outside torchrun: (None, cpu) and nothing is initialized. A
    group that is already initialized is kept (idempotent): its (rank, device) returned.
    """
    device = torch.device("cpu")
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), device
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None, torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = collective_timeout()
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    return dist.get_rank(), device


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """`init_device_mesh` whose every dimension's group waits `collective_timeout()`, not
    torch's default (a mesh's `new_group`s do not inherit the default group's timeout)."""
    backend = str(dist.get_backend())
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = collective_timeout()
    return init_device_mesh(device_type, shape, mesh_dim_names=names,
                            backend_override={name: (backend, options) for name in names})


# ----------------------------------------------------------------------------
# phases: errors that name the rank and the phase, and a watchdog


class _Watchdog:
    """One daemon thread per process: it checks the open phase twice a second and ends
    the process when that phase made no progress (`longstraw.heartbeat`) for `limit_s`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.current: tuple[str, float, float] | None = None  # (phase, start, limit_s)
        self.thread: threading.Thread | None = None

    def arm(self, name: str, limit_s: float) -> None:
        with self.lock:
            self.current = (name, time.monotonic(), limit_s)
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, name="longstraw-watchdog", daemon=True)
                self.thread.start()

    def disarm(self) -> None:
        with self.lock:
            self.current = None

    def silent_for(self) -> tuple[str, float, float] | None:
        """(phase, seconds since its last progress, seconds it has run) when the open
        phase is past its limit without progress; else None."""
        with self.lock:
            current = self.current
        if current is None:
            return None
        name, start, limit_s = current
        now = time.monotonic()
        silent = now - max(start, last_beat())
        return (name, silent, now - start) if silent > limit_s else None

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            stuck = self.silent_for()
            if stuck is not None:
                name, silent, ran = stuck
                print(f"longstraw watchdog: rank {_rank()} stuck in phase {name!r}: no progress for {silent:.1f} s "
                      f"(past 2x LONGSTRAW_COLLECTIVE_TIMEOUT={collective_timeout().total_seconds():g} s; the phase "
                      f"ran {ran:.1f} s); ending the process", file=sys.stderr, flush=True)
                os._exit(WATCHDOG_EXIT_CODE)


_WATCHDOG = _Watchdog()


def _rank() -> int | str:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"


_TRANSPORT_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection", "socket", "peer")


def _collective_error(exc: BaseException) -> bool:
    """A collective's failure (a dead, stopped or failed peer), not a bug in the step:
    LongStraw's `DistributedError`, torch's `DistError`s, or a RuntimeError from the
    transport (gloo raises plain RuntimeErrors naming itself)."""
    if isinstance(exc, DistributedError) or isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, LongStrawError):
        return False
    return any(word in str(exc).lower() for word in _TRANSPORT_WORDS)


@contextlib.contextmanager
def phase(name: str):
    """Run a phase of a step (rollouts, update, gradient reduce, checkpoint): a collective
    error inside it (a peer that died or stopped past the timeout) is raised as a
    `DistributedError` naming this rank, the phase and the timeout; and the watchdog ends
    the process if the phase makes no progress (`longstraw.heartbeat`) for twice the
    timeout. It may run as long as it needs while it makes progress. Phases do not nest
    (the inner one replaces the outer one's watch until it ends). With LONGSTRAW_PHASE_FILE set,
    the phase's name is written to `<that path>.rank<R>` as it starts (for benchmarks)."""
    timeout = collective_timeout().total_seconds()
    start = time.monotonic()
    _WATCHDOG.arm(name, 2 * timeout)
    if os.environ.get("LONGSTRAW_PHASE_FILE"):  # where a kill from outside landed (bench/fault_run_distributed.py)
        with contextlib.suppress(OSError):  # a report, never a reason to fail the step
            with open(f"{os.environ['LONGSTRAW_PHASE_FILE']}.rank{_rank()}", "w") as f:
                f.write(name)
    try:
        yield
    except RuntimeError as exc:
        if not _collective_error(exc) or str(exc).startswith("rank "):
            raise  # a bug or a NonFiniteError is not a peer's failure; an inner phase named it already
        raise DistributedError(
            f"rank {_rank()}: phase {name!r} failed after {time.monotonic() - start:.1f} s (collective timeout "
            f"{timeout:g} s, LONGSTRAW_COLLECTIVE_TIMEOUT): a peer died, stopped or hit an error first "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    finally:
        _WATCHDOG.disarm()


# ----------------------------------------------------------------------------
# test hooks: faults injected from the environment


def faults(kind: str) -> list[tuple[int, int]]:
    """The (rank, step) pairs of LONGSTRAW_FAULT's entries of this kind, e.g.
    LONGSTRAW_FAULT="kill@1:3,nan@0:5" (steps 0-based)."""
    out = []
    for entry in filter(None, os.environ.get("LONGSTRAW_FAULT", "").split(",")):
        name, _, where = entry.partition("@")
        if name == kind:
            rank, _, step = where.partition(":")
            out.append((int(rank), int(step)))
    return out


def inject_signal(step: int, rank: int, point: str = "step") -> None:
    """Test hooks, on the first attempt only (a restart must get past them): at `point`
    "step" of step S (0-based), LONGSTRAW_FAULT "kill@R:S" / "stop@R:S" makes rank R send
    itself SIGKILL / SIGSTOP; at the points "save" (the shards of checkpoint step-S are on
    disk, not yet renamed or marked) and "marker" (half of the `latest` marker written),
    "kill-save@R:S" / "kill-marker@R:S" kill it."""
    if restart_count() > 0:
        return
    kinds = (("kill", signal.SIGKILL), ("stop", signal.SIGSTOP)) if point == "step" else ((f"kill-{point}", signal.SIGKILL),)
    for kind, sig in kinds:
        if (rank, step) in faults(kind):
            os.kill(os.getpid(), sig)


@contextlib.contextmanager
def inject_delay(modules, step: int, rank: int):
    """Test hook, on the first attempt only: within the block, with LONGSTRAW_FAULT
    "slow@R:S", rank R's step S sleeps LONGSTRAW_FAULT_SLOW_S seconds (default 0.1) before
    each forward of each of `modules` (the decoder layers): a long step that keeps making
    progress (`longstraw.heartbeat`), for the watchdog's test."""
    if restart_count() > 0 or (rank, step) not in faults("slow"):
        yield
        return
    seconds = float(os.environ.get("LONGSTRAW_FAULT_SLOW_S", "0.1"))
    handles = [m.register_forward_pre_hook(lambda *_: time.sleep(seconds)) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "WATCHDOG_EXIT_CODE", "collective_timeout", "device_mesh", "faults", "init_distributed",
           "inject_delay", "inject_signal", "phase", "restart_count"]
