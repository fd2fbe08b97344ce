"""Elastic restarts onto the same curve (slow: each case is a few torchrun launches).

Under `torchrun --standalone --max-restarts 2`, the same command line starts a run and
restarts it (`--resume latest` with no checkpoint yet starts from step 0). One rank is
SIGKILLed once (LONGSTRAW_FAULT, on the first attempt only): inside a step, between the
DCP shards and the marker, and with half of the `latest` marker written. The group
restarts from the last complete checkpoint and ends on the uninterrupted run's weights,
bit for bit (float64, gloo: a restart replays the same steps on the same inputs). The
same for `longstraw train` under torchrun (context parallelism over both ranks) and for
`LongStrawGRPOTrainer` (`train(resume_from_checkpoint=True)`). A NaN on rank 1 only makes
both ranks skip the step (the template's JSON line counts it).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.test_example_torchrun import TASK

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--prompt-tokens", "16", "--num-facts", "1", "--num-values", "4", "--num-keys", "2", "--num-filler", "4",
         "--warm-steps", "0", "--group-size", "4", "--prompts-per-step", "2", "--lr", "1e-2", "--eval-prompts", "2",
         "--chunk-size", "8", "--no-progress", "--no-log-kl", "--threads", "1", "--dtype", "float64", "--steps", "3",
         "--eval-every", "100", "--checkpoint-every", "1"]


def torchrun(script: list, *args, fault: str = "", nproc: int = 2, restarts: int = 2, timeout: int = 300):
    """`torchrun --standalone --max-restarts N` of `script` (a path or ["-m", module]);
    returns its stdout's JSON lines. Raises with its output when it fails."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "LONGSTRAW_FAULT": fault}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", str(restarts), *script, *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]  # not HF's dict prints


def template(out, *args, fault=""):
    script = [os.path.join(REPO, "examples", "torchrun_grpo.py")]
    return torchrun(script, *TASK, "--steps", "3", "--save-every", "1", "--resume", "latest",
                    "--checkpoint-dir", str(out / "ck"), "--dump", str(out / "final.pt"), *args, fault=fault)


def _weights(path):
    return torch.load(path, weights_only=True)


def _bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    (line,) = template(out)
    assert line["start"] == 0 and line["restart_count"] == 0  # --resume latest, no checkpoint yet: step 0
    return _weights(out / "final.pt")


@pytest.mark.parametrize("fault", ["kill@1:1", "kill-save@0:2", "kill-marker@0:2"])
def test_template_restarts_onto_the_same_weights(tmp_path, uninterrupted, fault):
    (line,) = template(tmp_path, fault=fault)
    assert line["restart_count"] == 1  # it was killed once and restarted
    assert line["start"] == 1  # the last complete checkpoint: step-1 (step-2 was killed before its marker)
    _bitwise(uninterrupted, _weights(tmp_path / "final.pt"))
    assert (tmp_path / "ck" / "latest").read_text().endswith("step-3")
    assert not any(n.endswith(".partial") for n in os.listdir(tmp_path / "ck"))


def test_template_skips_a_nan_on_one_rank(tmp_path, uninterrupted):
    (line,) = template(tmp_path, fault="nan@1:2")  # the last step's gradient is NaN on rank 1 only
    assert line["skipped_nonfinite_steps"] == 1
    step2 = tmp_path / "two"
    step2.mkdir()
    torchrun([os.path.join(REPO, "examples", "torchrun_grpo.py")], *TASK, "--steps", "2", "--dump",
             str(step2 / "final.pt"), restarts=0)
    _bitwise(_weights(step2 / "final.pt"), _weights(tmp_path / "final.pt"))  # step 3 changed nothing on any rank


def test_template_stops_after_nonfinite_steps_in_a_row(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "LONGSTRAW_FAULT": "nan@1:0,nan@0:1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "examples", "torchrun_grpo.py"), *TASK, "--steps", "3", "--max-nonfinite-steps", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "NonFiniteError" in done.stderr and "2 steps in a row" in done.stderr


def test_longstraw_train_restarts_onto_the_same_weights(tmp_path):
    runs = {}
    for name, fault in (("straight", ""), ("killed", "kill@1:1")):
        torchrun(["-m", "longstraw.cli", "train"], *TRAIN, "--out-dir", str(tmp_path / name), fault=fault)
        runs[name] = torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    assert runs["killed"]["step"] == 3
    _bitwise(runs["straight"]["model"], runs["killed"]["model"])
    steps = [json.loads(line)["step"] for line in open(tmp_path / "killed" / "log.jsonl")]
    assert steps == [0, 1, 2, 3]  # the log replays without duplicates


def test_longstraw_train_skips_a_nan_on_one_rank(tmp_path):
    torchrun(["-m", "longstraw.cli", "train"], *TRAIN, "--out-dir", str(tmp_path), fault="nan@1:1", restarts=0)
    log = [json.loads(line) for line in open(tmp_path / "log.jsonl")][1:]
    assert [r["skipped_nonfinite_steps"] for r in log] == [0, 1, 1]  # rank 0's own norm was finite (it logs)


def test_the_trl_trainer_restarts_onto_the_same_weights(tmp_path):
    """`LongStrawGRPOTrainer` under torchrun (W = 2, C = 1, a checkpoint every step,
    `train(resume_from_checkpoint=True)`: the first start finds none and starts at step 0):
    rank 1 SIGKILLed at the end of step 2, before its checkpoint; the restarted group
    resumes from checkpoint-1 and ends on the uninterrupted run's weights, bit for bit."""
    pytest.importorskip("trl")
    script = [os.path.join(REPO, "tests", "integrations", "trl_restart_worker.py")]
    for name, kill_at in (("straight", "0"), ("killed", "2")):
        (tmp_path / name).mkdir()
        torchrun(script, str(tmp_path / name), kill_at)
    assert (tmp_path / "straight" / "attempts.txt").read_text().split("\n")[:-1] == ["0 0"]
    assert (tmp_path / "killed" / "attempts.txt").read_text().split("\n")[:-1] == ["0 0", "1 1"]  # resumed at 1
    _bitwise(_weights(tmp_path / "straight" / "final.pt"), _weights(tmp_path / "killed" / "final.pt"))
