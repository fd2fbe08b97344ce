"""The loop's files (longstraw/checkpoint.py): the JSONL log appends one line per step
without rewriting the log, survives a torn last line, and resume keeps the steps done; a
folder of DCP checkpoints is marked atomically, after the checkpoint is complete."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from longstraw.checkpoint import (append_log, commit_step_dir, load_checkpoint, prune_step_dirs, read_log, read_marker,
                                  step_dir, truncate_log, write_atomic, write_marker)
from longstraw.errors import CheckpointError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _steps(path):
    return [json.loads(line)["step"] for line in read_log(path).splitlines()]


def test_append_adds_one_line_in_place(tmp_path):
    path = str(tmp_path / "log.jsonl")
    append_log(path, {"step": 1, "loss": 0.5})
    inode = os.stat(path).st_ino
    append_log(path, {"step": 2, "loss": 0.25})
    assert _steps(path) == [1, 2]
    assert os.stat(path).st_ino == inode  # appended, not rewritten by rename
    assert not os.path.exists(path + ".tmp")


def test_append_after_a_torn_line_keeps_every_line_json(tmp_path):
    path = str(tmp_path / "log.jsonl")
    append_log(path, {"step": 1})
    with open(path, "ab") as f:
        f.write(b'{"step": 2, "lo')  # killed inside a write
    append_log(path, {"step": 2, "loss": 1.0})
    assert _steps(path) == [1, 2]
    assert read_log(path).endswith(b"\n")


def test_truncate_keeps_the_steps_done_and_drops_a_torn_line(tmp_path):
    path = str(tmp_path / "log.jsonl")
    for step in (0, 1, 2, 3):
        append_log(path, {"step": step})
    with open(path, "ab") as f:
        f.write(b'{"step": 4')
    truncate_log(path, 2)
    assert _steps(path) == [0, 1, 2]
    truncate_log(str(tmp_path / "none.jsonl"), 2)  # no log yet: nothing to do
    assert not os.path.exists(tmp_path / "none.jsonl")


def test_write_atomic_leaves_the_old_file_when_writing_fails(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    write_atomic(path, lambda f: torch.save({"w": torch.ones(2)}, f))

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomic(path, broken)
    assert torch.equal(load_checkpoint(path)["w"], torch.ones(2))


def test_load_checkpoint_refuses_a_broken_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_checkpoint(str(path))


# ----------------------------------------------------------------------------
# a folder of DCP checkpoints: step-N folders and the `latest` marker

_KILLED_MID_MARKER = """
import os, signal, sys
from longstraw.checkpoint import write_marker
write_marker(sys.argv[1], sys.argv[2], between=lambda: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_no_marker_yet_is_a_first_start(tmp_path):
    assert read_marker(str(tmp_path)) is None


def test_a_kill_inside_the_marker_write_leaves_the_previous_checkpoint_marked(tmp_path):
    """The process is SIGKILLed with half of the new marker written: `latest` still names
    the previous checkpoint (seen red with the marker written in place: an empty or half
    marker, CheckpointError on resume)."""
    folder = str(tmp_path)
    for step in (1, 2):
        os.makedirs(step_dir(folder, step))
    write_marker(folder, step_dir(folder, 1))
    done = subprocess.run([sys.executable, "-c", _KILLED_MID_MARKER, folder, step_dir(folder, 2)],
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert read_marker(folder) == os.path.abspath(step_dir(folder, 1))


def test_commit_renames_then_marks_and_prune_keeps_the_marked_one(tmp_path):
    folder = str(tmp_path)
    for step in (1, 2, 3):
        partial = step_dir(folder, step) + ".partial"
        os.makedirs(partial)
        (tmp_path / f"step-{step}.partial" / "shard").write_text(str(step))
        if step == 3:
            os.makedirs(step_dir(folder, 3))  # a stale unmarked step-3 a killed attempt left: replaced
        commit_step_dir(partial, step_dir(folder, step))
        assert read_marker(folder) == os.path.abspath(step_dir(folder, step))
    assert (tmp_path / "step-3" / "shard").read_text() == "3"
    os.makedirs(step_dir(folder, 4) + ".partial")  # a save killed before its rename
    gone = prune_step_dirs(folder, keep=2)
    assert sorted(os.listdir(folder)) == ["latest", "step-2", "step-3"], gone
    write_marker(folder, step_dir(folder, 2))  # the marked one is never pruned, even when old
    prune_step_dirs(folder, keep=1)
    assert sorted(os.listdir(folder)) == ["latest", "step-2", "step-3"]


def test_a_marker_naming_a_missing_folder_is_an_error(tmp_path):
    (tmp_path / "latest").write_text("")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        read_marker(str(tmp_path))
