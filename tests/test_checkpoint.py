"""The loop's files (longstraw/checkpoint.py): the JSONL log appends one line per step
without rewriting the log, survives a torn last line, and resume keeps the steps done."""

import json
import os

import pytest
import torch

from longstraw.checkpoint import append_log, load_checkpoint, read_log, truncate_log, write_atomic
from longstraw.errors import CheckpointError


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
