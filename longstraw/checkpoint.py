"""The training loop's files, each written so that a run killed at any moment leaves the
old file or the new one (write-then-rename): checkpoints (loaded weights-only) and the
JSONL log of one line per step."""

from __future__ import annotations

import json
import os
import shutil

import torch

from longstraw.errors import CheckpointError


def write_atomic(path: str, write) -> None:
    """Write `path` by write-then-rename: `write(f)` fills `path + ".tmp"` (same directory,
    binary), which is fsynced and renamed over `path` (`os.replace` is atomic), then the
    directory is fsynced. A run killed at any moment leaves the old file or the new one,
    never a part of one (a stale .tmp at most, overwritten by the next write)."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str) -> dict:
    """A checkpoint written by the loop, loaded with `torch.load(weights_only=True)`:
    tensors and plain containers only, never arbitrary pickled objects."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # UnpicklingError for a forbidden object; others for a broken file
        raise CheckpointError(f"cannot load the checkpoint {path} with weights_only=True ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); the loop only loads its own "
                              "checkpoints: tensors and plain containers. Delete it or pass --no-resume") from exc


def read_log(path: str) -> bytes:
    """The log's bytes (empty when there is none yet)."""
    if not os.path.exists(path):
        return b""
    with open(path, "rb") as f:
        return f.read()


def _whole_lines(data: bytes) -> list[bytes]:
    """The log's complete lines: a last line without its newline (a run killed inside a
    write) is dropped; every complete line must be JSON."""
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith(b"\n"):
        lines.pop()
    return lines


def truncate_log(path: str, step: int) -> None:
    """Keep the log lines of the `step` steps done (a resumed run writes the rest); a torn
    last line is dropped too."""
    if not os.path.exists(path):
        return
    keep = [line for line in _whole_lines(read_log(path)) if json.loads(line).get("step", -1) <= step]
    write_atomic(path, lambda f: f.writelines(keep))


def append_log(path: str, record: dict) -> None:
    """Append one JSON line to the log: O(line), not O(log) (one `write` of the whole line
    in append mode, then fsync). A run killed inside that write leaves at most a torn last
    line without its newline; the next append cuts it off first (the one O(log) case),
    and `truncate_log` (resume) drops it too. A write or fsync that raises is undone: the
    log is left as it was."""
    line = (json.dumps(record) + "\n").encode()
    with open(path, "ab+") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.seek(0)
                f.truncate(len(b"".join(_whole_lines(f.read()))))
        end = f.tell()
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.truncate(end)  # all or nothing, as the rename-written files: the log as it was
            raise


# ----------------------------------------------------------------------------
# a folder of sharded checkpoints (DCP): step-N folders and the `latest` marker
#
# A checkpoint is complete or absent: it is written as step-N.partial, renamed to step-N
# once every rank's shard is on disk, and only then does `latest` (written atomically)
# name it. The checkpoint `latest` named before stays until then; older ones may be
# pruned after.

MARKER = "latest"


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def read_marker(folder: str) -> str | None:
    """The checkpoint `folder/latest` names (an absolute path), or None when there is no
    marker yet (a first start). A marker that names a missing folder is a CheckpointError."""
    path = os.path.join(folder, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    target = name if os.path.isabs(name) else os.path.join(folder, name)
    if not name or not os.path.isdir(target):
        raise CheckpointError(f"{path} names {name!r}, which is not a checkpoint folder; delete the marker to start "
                              "from step 0, or point --resume at a step-N folder")
    return target


def write_marker(folder: str, target: str, between=None) -> None:
    """`folder/latest` := target's absolute path, atomically (write_atomic: temp file in the
    same folder, fsync, os.replace). `between()`, if given, runs with half of it written
    (a test's kill lands inside the write)."""
    name = os.path.abspath(target).encode()

    def write(f):
        f.write(name[: len(name) // 2])
        if between is not None:
            f.flush()
            between()
        f.write(name[len(name) // 2:])

    write_atomic(os.path.join(folder, MARKER), write)


def commit_step_dir(partial: str, target: str, between=None) -> None:
    """Rename a fully written `partial` checkpoint folder to `target` (replacing a stale
    one a killed attempt left unmarked), fsync the parent, then mark it `latest`."""
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(partial, target)
    folder = os.path.dirname(os.path.abspath(target))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    write_marker(folder, target, between)


def prune_step_dirs(folder: str, keep: int) -> list[str]:
    """Delete all but the `keep` newest step-N folders (0: keep all) and every stale
    .partial folder; the marked one is never deleted. Returns what was deleted."""
    marked = read_marker(folder)
    names = [n for n in os.listdir(folder) if n.startswith("step-")]
    done = sorted((n for n in names if n[5:].isdigit()), key=lambda n: int(n[5:]))
    doomed = [n for n in names if n.endswith(".partial")] + (done[:-keep] if keep > 0 else [])
    gone = []
    for name in doomed:
        path = os.path.join(folder, name)
        if marked is None or os.path.abspath(path) != os.path.abspath(marked):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone
