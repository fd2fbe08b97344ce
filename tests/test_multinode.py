"""Multi-node launch on one machine (slow): two `torchrun --nnodes 2 --nproc-per-node 1
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT` launchers (two "nodes" of one process
each, a c10d rendezvous hosted by whichever launcher gets the port) train the template to
the same weights as one node of two processes, bit for bit (float64, gloo: the same ranks
run the same kernels on the same inputs whichever launcher started them). C = 2 (one
context-parallel group over both nodes, FSDP2 across them) and C = 1 (two data-parallel
groups)."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.test_example_torchrun import TASK

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "torchrun_grpo.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}


def _one_node_then_two(script_args_one: list[str], script_args_two: list[str], rdzv: str) -> None:
    """`script` (the first of each list) under one torchrun of two processes, then under two
    launchers of one process each over a c10d rendezvous (`rdzv`-PORT): every run must exit 0."""
    one = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script_args_one]
    done = subprocess.run(one, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    port = _port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"{rdzv}-{port}",
            *script_args_two]
    launchers = [subprocess.Popen(node, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in launchers), "\n".join(log[-2000:] for log in logs)


def _assert_same_weights(one_path, two_path) -> None:
    a, b = (torch.load(path, weights_only=True) for path in (one_path, two_path))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("context", [2, 1])
def test_two_launchers_equal_one_node_of_two(tmp_path, context):
    args = [*TASK, "--steps", "2", "--context-parallel", str(context)]
    _one_node_then_two([SCRIPT, *args, "--dump", str(tmp_path / "one.pt")],
                       [SCRIPT, *args, "--dump", str(tmp_path / "two.pt")], "multinode")
    _assert_same_weights(tmp_path / "one.pt", tmp_path / "two.pt")


def test_two_launchers_equal_one_node_of_two_for_the_trl_trainer(tmp_path):
    """The same for `LongStrawGRPOTrainer` (W = 2, C = 1, 3 steps; tests/integrations/trl_restart_worker.py)."""
    pytest.importorskip("trl")
    script = os.path.join(REPO, "tests", "integrations", "trl_restart_worker.py")
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    _one_node_then_two([script, str(tmp_path / "one"), "0"], [script, str(tmp_path / "two"), "0"], "trl")
    _assert_same_weights(tmp_path / "one" / "final.pt", tmp_path / "two" / "final.pt")
