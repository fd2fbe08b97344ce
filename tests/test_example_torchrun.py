"""(-m slow) examples/torchrun_grpo.py under torchrun (gloo, CPU, float64, tiny model): W = 2 (one
context-parallel group of two, FSDP2 over it, exact mode) trains 3 steps with a DCP
checkpoint after each; the W = 2 checkpoint of step 2 loaded at W = 1 continues to the
same step-3 weights (one process takes the same prompts and samples: the example's update
is one process's over the global batch), and (`-m slow`) resumed at W = 2 from step 1 it
ends on the same weights."""

import os
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--prompt-tokens", "48", "--chunk-size", "16", "--facts", "2", "--values", "2", "--keys", "2", "--filler",
        "2", "--group-size", "8", "--prompts", "2", "--lr", "1e-2", "--mode", "exact", "--dtype", "float64"]


def _torchrun(world: int, *args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.join(REPO, "examples", "torchrun_grpo.py"),
           *TASK, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() <= rel * a[name].abs().max() + 1e-300, name


def _train_three_steps(tmp_path) -> dict:
    """W = 2 trains 3 steps with a checkpoint after each; its final weights."""
    ck = tmp_path / "ck"
    _torchrun(2, "--steps", "3", "--save-every", "1", "--checkpoint-dir", str(ck), "--dump", str(tmp_path / "a.pt"))
    assert (ck / "latest").read_text().strip().endswith("step-3")
    return torch.load(tmp_path / "a.pt", weights_only=True)


@pytest.mark.slow  # two torchrun launches, 45 s on 2 idle cores; the launch itself: tests/parallel/test_launch.py
def test_train_and_load_at_another_world(tmp_path):
    """The W = 2 checkpoint of step 2, loaded at W = 1, continues to the same step-3
    weights; and the run trained."""
    a = _train_three_steps(tmp_path)
    _torchrun(1, "--steps", "3", "--resume", str(tmp_path / "ck" / "step-2"), "--dump", str(tmp_path / "c.pt"))
    _close(a, torch.load(tmp_path / "c.pt", weights_only=True), 1e-9)  # loads and continues alike
    from longstraw.tiny import tiny_model  # the example's initial weights: seed 0, the task's vocabulary
    from longstraw.tasks import KVRecall, Vocab

    vocab = KVRecall(48, num_facts=2, vocab=Vocab(num_values=2, num_keys=2, num_filler=2)).vocab
    init = dict(tiny_model("qwen3", dtype=torch.float64, vocab_size=vocab.size,
                           max_position_embeddings=48 + 64).named_parameters())
    assert any((a[n] - init[n].detach()).abs().max() > 0 for n in a)  # it trained


@pytest.mark.slow
def test_resume_at_the_same_world_continues_the_curve(tmp_path):
    a = _train_three_steps(tmp_path)
    _torchrun(2, "--steps", "3", "--resume", str(tmp_path / "ck" / "step-1"), "--dump", str(tmp_path / "b.pt"))
    _close(a, torch.load(tmp_path / "b.pt", weights_only=True), 1e-12)  # resumed at the same W: the same curve
