"""parallel/launch.py and parallel/nonfinite.py at W = 2 (gloo, CPU, torchrun's environment
set by hand; one worker process per rank, tests/parallel/launch_worker.py):

* a rank stopped with SIGSTOP makes its peer raise a DistributedError naming the rank and
  the phase within LONGSTRAW_COLLECTIVE_TIMEOUT (3 s here), not the group's 30 minutes;
* a phase stuck past twice the timeout is ended by the watchdog (exit code 70);
* the watchdog watches progress: a phase of 3.5x the timeout whose collectives complete
  runs to its end; one that stops making progress is ended twice the timeout after its
  last progress;
* a NaN gradient on rank 1 only makes both ranks skip the step (weights and AdamW state
  untouched), counted; N in a row raise NonFiniteError."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from longstraw.errors import DistributedError
from longstraw.parallel.launch import DEFAULT_COLLECTIVE_TIMEOUT_S, WATCHDOG_EXIT_CODE, collective_timeout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode: str, out: str, world: int, **env) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(world):
        e = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
             "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env}
        e.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.parallel.launch_worker", mode, out], cwd=REPO,
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _reap(procs, timeout: float) -> list[str]:
    """Wait for every worker (killing what is left at the deadline, a stopped one too)."""
    deadline, logs = time.monotonic() + timeout, []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    return logs


def _result(out, rank):
    with open(f"{out}.rank{rank}.json") as f:
        return json.load(f)


def test_a_stopped_rank_makes_its_peer_raise_within_the_timeout(tmp_path):
    out = str(tmp_path / "hang")
    procs = _start("hang", out, 2, LONGSTRAW_COLLECTIVE_TIMEOUT="3")
    try:
        logs = _reap(procs[:1], 60)  # rank 0 must end by itself
    finally:
        os.kill(procs[1].pid, signal.SIGKILL)  # the stopped rank
        procs[1].communicate()
    assert os.path.exists(f"{out}.rank0.json"), (procs[0].returncode, logs)  # exit 70: only the watchdog ended it
    seen = _result(out, 0)
    assert seen["raised"], logs
    print(f"time to error: {seen['seconds']:.2f} s (LONGSTRAW_COLLECTIVE_TIMEOUT=3)")
    assert 2.5 <= seen["seconds"] <= 15, seen  # the stated timeout, not gloo's 30 minutes
    assert "rank 0" in seen["message"] and "gradient all-reduce" in seen["message"], seen["message"]


def test_the_watchdog_ends_a_phase_stuck_past_twice_the_timeout(tmp_path):
    start = time.monotonic()
    (proc,) = _start("watchdog", str(tmp_path / "wd"), 1, LONGSTRAW_COLLECTIVE_TIMEOUT="1")
    (log,) = _reap([proc], 30)
    assert proc.returncode == WATCHDOG_EXIT_CODE, log
    assert "rank ? stuck in phase 'a stuck kernel'" in log, log
    assert time.monotonic() - start < 20


def test_a_phase_longer_than_twice_the_timeout_completes_while_its_collectives_do(tmp_path):
    out = str(tmp_path / "long")
    procs = _start("long", out, 2, LONGSTRAW_COLLECTIVE_TIMEOUT="1")
    logs = _reap(procs, 60)
    assert all(p.returncode == 0 for p in procs), ([p.returncode for p in procs], logs)  # 70: the watchdog ended it
    for rank in (0, 1):
        seen = _result(out, rank)
        assert seen["completed"] and seen["seconds"] >= 3.5 and seen["calls"] > 5, seen


@pytest.mark.slow  # 15 s on loaded cores; the fast case of the progress watch is the test above
def test_the_watchdog_counts_from_the_last_progress_not_the_phase_start(tmp_path):
    (proc,) = _start("silent", str(tmp_path / "silent"), 1, LONGSTRAW_COLLECTIVE_TIMEOUT="1")
    (log,) = _reap([proc], 30)
    ended = time.monotonic()
    assert proc.returncode == WATCHDOG_EXIT_CODE, log
    assert "rank ? stuck in phase 'a kernel that stops': no progress for 2." in log, log
    last = float(log.split("last beat at ")[1].split()[0])
    assert 2.0 <= ended - last <= 6.0, (ended - last, log)  # 2x the timeout after the last beat (+ the 0.5 s poll)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    out = str(tmp_path / "nan")
    procs = _start("nan", out, 2, LONGSTRAW_FAULT="nan@1:0,nan@1:2,nan@1:3")
    logs = _reap(procs, 60)
    assert all(p.returncode == 0 for p in procs), logs
    r0, r1 = _result(out, 0), _result(out, 1)
    for r in (r0, r1):
        assert r["step0"] == [True, True]  # skipped, and the weights did not move (rank 0's gradient was finite)
        assert r["adam_state_after_skip"] == 0  # nor did AdamW's moments
        assert r["step1"] == [False, False]  # a finite step steps
        assert r["total"] == 1
        assert r["raised"] and "2 steps in a row" in r["raised"]
    assert r0["weights"] == r1["weights"]  # the replicas stayed equal, bit for bit


def test_collective_timeout_is_stated_and_checked(monkeypatch):
    monkeypatch.delenv("LONGSTRAW_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout().total_seconds() == DEFAULT_COLLECTIVE_TIMEOUT_S == 600
    monkeypatch.setenv("LONGSTRAW_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout().total_seconds() == 2.5
    for bad in ("soon", "0"):
        monkeypatch.setenv("LONGSTRAW_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(DistributedError, match="LONGSTRAW_COLLECTIVE_TIMEOUT"):
            collective_timeout()


def test_a_phase_names_collective_failures_and_leaves_other_errors_alone():
    from longstraw.errors import NonFiniteError
    from longstraw.parallel.launch import phase

    with pytest.raises(DistributedError, match=r"rank \?: phase 'update' failed .*Connection reset by peer"):
        with phase("update"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as bug:
        with phase("update"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")
    assert not isinstance(bug.value, DistributedError)  # a bug is not reported as a dead peer
    with pytest.raises(NonFiniteError):
        with phase("update"):
            raise NonFiniteError("3 steps in a row")


def _template(timeout_s: int, fault: str, *args, slow_s: float = 0.1) -> subprocess.CompletedProcess:
    """examples/torchrun_grpo.py under `torchrun --standalone --max-restarts 0` (W = 2, the
    tests' TASK, exact mode) with LONGSTRAW_COLLECTIVE_TIMEOUT and LONGSTRAW_FAULT set."""
    from tests.test_example_torchrun import TASK

    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "LONGSTRAW_FAULT": fault,
           "LONGSTRAW_FAULT_SLOW_S": str(slow_s), "LONGSTRAW_COLLECTIVE_TIMEOUT": str(timeout_s)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "0", os.path.join(REPO, "examples", "torchrun_grpo.py"), *TASK, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow  # a torchrun launch, 90 s on loaded cores
def test_a_template_step_of_three_times_the_timeout_completes():
    done = _template(3, "slow@0:0,slow@1:0", "--steps", "1")  # each layer forward of step 0 sleeps 0.1 s
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"')]
    print(f"step 0: {line['step_seconds'][0]:.1f} s (LONGSTRAW_COLLECTIVE_TIMEOUT=3)")
    assert line["step_seconds"][0] >= 3 * 3, line  # past the old per-phase limit of 2x the timeout, completed


@pytest.mark.slow  # a torchrun launch, then torchrun's 30 s grace before it kills the stopped rank
def test_a_sigstopped_template_rank_is_named_within_the_timeout():
    done = _template(3, "stop@1:1", "--steps", "3")
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    named = [x for x in log.splitlines() if "DistributedError: rank 0: phase 'step 1: rollouts and update' failed" in x]
    assert named, log[-4000:]
    seconds = float(named[0].split("failed after ")[1].split(" s")[0])
    print(named[0])
    assert 2.5 <= seconds <= 3 + 5, named[0]  # the stated timeout (+ start-up of the phase), not 2x, not 30 min
