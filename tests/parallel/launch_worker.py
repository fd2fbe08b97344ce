"""One rank of tests/parallel/test_launch.py, started as `python -m tests.parallel.launch_worker
MODE OUT` with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set by the
test, so `init_distributed` runs as under torchrun. It writes what it saw to OUT.rank<R>.json.

Modes:
    hang      rank 1 stops itself (SIGSTOP) before an all-reduce inside a phase; rank 0
              must raise DistributedError within LONGSTRAW_COLLECTIVE_TIMEOUT (it records
              the time to error and the message).
    watchdog  one rank, a phase that sleeps past twice the timeout: the watchdog ends it.
    long      two ranks, a phase of 3.5x the timeout whose all-reduces (parallel.collectives)
              keep completing: it must complete (the watchdog watches progress).
    silent    one rank, a phase that beats for 1.5x the timeout, then sleeps: the watchdog
              ends it twice the timeout after the last beat, not after the phase began.
    nan       a tiny Linear replicated on both ranks; LONGSTRAW_FAULT=nan@1:0 poisons rank
              1's gradient at step 0: both ranks skip (weights and AdamW state untouched),
              step 1 is finite and steps; then NaN steps in a row raise NonFiniteError.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from longstraw.errors import DistributedError, NonFiniteError
from longstraw.heartbeat import beat
from longstraw.parallel.collectives import all_reduce_sum
from longstraw.parallel.data import process_group_view
from longstraw.parallel.launch import collective_timeout, init_distributed, phase
from longstraw.parallel.nonfinite import NonFiniteGuard


def _hang(rank: int) -> dict:
    t = torch.ones(1, dtype=torch.float64)
    dist.all_reduce(t)  # both alive: the group works
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped; the test kills it
    start = time.monotonic()
    try:
        with phase("gradient all-reduce"):
            dist.all_reduce(t)
    except DistributedError as exc:
        return {"raised": True, "seconds": time.monotonic() - start, "message": str(exc)}
    return {"raised": False, "seconds": time.monotonic() - start}


def _watchdog() -> dict:
    with phase("a stuck kernel"):
        time.sleep(60)  # never reached: os._exit from the watchdog thread
    return {"raised": False}


def _long() -> dict:
    timeout = collective_timeout().total_seconds()
    world = process_group_view(dist.group.WORLD)
    start = time.monotonic()
    calls = 0
    with phase("a long update"):
        while time.monotonic() - start < 3.5 * timeout:
            all_reduce_sum(torch.ones(1, dtype=torch.float64), world)  # completes: progress
            calls += 1
            time.sleep(0.1)
    return {"completed": True, "seconds": time.monotonic() - start, "calls": calls}


def _silent() -> dict:
    timeout = collective_timeout().total_seconds()
    with phase("a kernel that stops"):
        start = time.monotonic()
        while time.monotonic() - start < 1.5 * timeout:
            beat()
            time.sleep(0.1)
        print(f"last beat at {time.monotonic():.3f}", flush=True)
        time.sleep(60)  # never reached: os._exit from the watchdog thread
    return {"raised": False}


def _nan(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    guard = NonFiniteGuard(max_in_row=2)
    x = torch.randn(5, 4, dtype=torch.float64)
    seen = {}

    def step(i):
        model(x).square().sum().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        skipped = guard.skip_if_nonfinite(model.parameters(), i, rank=rank)
        opt.step()  # as HF's Trainer does: it steps whatever; without .grad AdamW leaves a parameter alone
        opt.zero_grad(set_to_none=True)
        same = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        return skipped, same

    seen["step0"] = step(0)  # rank 1's gradient is NaN (LONGSTRAW_FAULT=nan@1:0)
    seen["adam_state_after_skip"] = len(opt.state)
    seen["step1"] = step(1)  # finite everywhere: every rank steps
    seen["total"] = guard.total
    try:
        for i in (2, 3):  # nan@1:2 and nan@1:3: two in a row
            step(i)
        seen["raised"] = None
    except NonFiniteError as exc:
        seen["raised"] = str(exc)
    seen["weights"] = [p.detach().flatten().tolist() for p in model.parameters()]
    return seen


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode in ("watchdog", "silent"):
        result = _watchdog() if mode == "watchdog" else _silent()
        rank = 0
    elif mode == "long":
        rank, _ = init_distributed()
        result = _long()
        dist.barrier()
    else:
        rank, _ = init_distributed()
        result = _hang(rank) if mode == "hang" else _nan(rank)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    if mode in ("nan", "long"):
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # a hang test's rank 0 must not wait for its stopped peer at exit


if __name__ == "__main__":
    main()
