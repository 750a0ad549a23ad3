"""Directories that appear whole or not at all: staged under a name of their own, swapped in with two renames, made
durable with ``fsync``, and written by one job at a time.

A save of ``<dir>/<name>`` goes like this (:mod:`~lightning_par3d.checkpoint.dcp` for par3d's checkpoints,
:mod:`~lightning_par3d.integrations.accelerate_state` for Accelerate's ``save_state`` folders):

1. :class:`SaveLock` on ``.<name>.lock`` (an ``flock``, which the kernel releases when the process ends, so a job
   killed mid-save never leaves a lock behind): a second job saving to the same path at the same time gets
   :class:`CheckpointInUse`, naming the host, process and job that holds it, instead of the two deleting each
   other's files. Holding it, the saver removes what earlier, killed saves of that name left (:func:`leftovers`).
2. Everything is written into ``.<name>.partial-<token>`` (:func:`staging_name`), a token new for every save, so
   no two saves ever share a staging directory.
3. :func:`swap_into_place`: the files and the directory are flushed to disk, the previous ``<name>`` (if any) is
   renamed to ``.<name>.old``, the staging directory to ``<name>``, the parent directory is ``fsync``-ed (so the
   renames survive a power loss as well as a kill), and ``.<name>.old`` is removed.

Killed at any point, the previous checkpoint stays complete: at ``<name>``, or between the two renames at
``.<name>.old``, where :func:`resolve` (every load) finds it and the next save puts it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

_JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
"""What names a job in a lock's owner record (whichever the launcher set)."""


def staging_name(path: Path, token: str | None = None) -> Path:
    """Where a save of ``path`` is written before it takes its name: a hidden sibling unique to the save."""
    return path.parent / f".{path.name}.partial-{token or new_token()}"


def previous_name(path: Path) -> Path:
    """Where the checkpoint a save replaces waits between the swap's two renames."""
    return path.parent / f".{path.name}.old"


def lock_name(path: Path) -> Path:
    return path.parent / f".{path.name}.lock"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def leftovers(path: Path) -> list[Path]:
    """What killed saves of ``path`` left: staging directories of any job (and the fixed ``.partial`` name of earlier
    par3d versions). Only the holder of ``path``'s :class:`SaveLock` may remove them: no other save of it is running
    then."""
    return sorted(path.parent.glob(f".{_glob_escape(path.name)}.partial*"))


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def resolve(path: Path, complete: Callable[[Path], bool]) -> Path:
    """``path``, or the previous checkpoint a save killed between its two renames left at ``.<name>.old`` (where
    ``path`` is missing and that one is ``complete``)."""
    if not path.exists() and complete(previous_name(path)):
        return previous_name(path)
    return path


def restore_previous(path: Path, complete: Callable[[Path], bool]) -> None:
    """Puts back a previous checkpoint that a killed save left aside (see :func:`resolve`)."""
    if not path.exists() and complete(previous_name(path)):
        os.rename(previous_name(path), path)
        fsync_directory(path.parent)


def swap_into_place(staging: Path, path: Path) -> None:
    """``staging`` takes the name ``path`` (see the module docstring): flushed, swapped with two renames, the
    parent directory flushed, the previous one removed."""
    fsync_tree(staging)
    previous = previous_name(path)
    shutil.rmtree(previous, ignore_errors=True)
    if path.exists():
        os.rename(path, previous)
    os.rename(staging, path)
    fsync_directory(path.parent)
    shutil.rmtree(previous, ignore_errors=True)


def fsync_directory(directory: Path) -> None:
    """Flushes ``directory``'s entries (the names renames and creations gave) to disk."""
    with contextlib.suppress(OSError):  # a filesystem that cannot open or sync directories (some network ones)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flushes every file and directory under ``root`` (DCP's writer syncs its shards already; Accelerate's and
    Lightning's own files are flushed here before they take their name)."""
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_directory(Path(directory))


class CheckpointInUse(RuntimeError):
    """Another job is saving to the same checkpoint path."""


class SaveLock:
    """The right to save ``path``, for one process at a time (``flock`` on ``.<name>.lock``, see the module
    docstring). :meth:`acquire` raises :class:`CheckpointInUse` at once where another process holds it; the lock
    file records who holds it, for that message. :meth:`release` (or the end of the process) frees it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> SaveLock:
        file = lock_name(self.path)
        file.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # the file may be removed by its last holder between our open and our lock: open anew
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_owner(fd)
                os.close(fd)
                raise CheckpointInUse(
                    f"Another job is saving to {self.path} right now ({holder}). Two jobs must not write one "
                    "checkpoint path: their files would mix. Give each job its own directory (ModelCheckpoint's "
                    "dirpath, the path passed to save), or stop the other job."
                ) from None
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(file).st_ino:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps(_owner()).encode(), 0)
                    self._fd = fd
                    return self
            os.close(fd)
        raise CheckpointInUse(f"Could not lock {file}: it is being created and removed by other processes.")

    def release(self) -> None:
        """Frees the lock (and removes its file, so that no lock files pile up beside the checkpoints)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(lock_name(self.path))
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _owner() -> dict[str, object]:
    job = {name: os.environ[name] for name in _JOB_VARIABLES if name in os.environ}
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job, "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read_owner(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        owner = {}
    if not owner:
        return "its lock file names no holder"
    job = ", ".join(f"{k}={v}" for k, v in dict(owner.get("job") or {}).items())
    return f"held by process {owner.get('pid')} on {owner.get('host')} since {owner.get('since')}" + (
        f", job {job}" if job else ""
    )
