"""Every rank raising the same error, or going on together, where one rank's step could fail alone.

A rank that raises where its peers go on leaves them waiting in the next collective until the timeout, and then
every rank fails with a message about the timeout instead of the cause. Three steps of par3d can fail on some ranks
only, and each ends here:

* :func:`on_rank_zero` — a step only rank 0 takes (a checkpoint's lock, staging directory and renames): its value
  or its error, sent to every rank. :func:`on_rank_zero_for_long` is the same for a step that may outlast the
  collectives' timeout (``layout="auto"``'s plan): the others wait for it on the job's store, as long as it may take.
* :func:`check_directory_is_shared` — the checkpoint directory seen by every node (a probe file rank 0 writes),
  before the first save: on node-local disks each node would hold part of every checkpoint.
* :func:`same_refusal` — a step that may fail on some ranks inside collectives (measuring a layout): decided
  through the job's key-value store, never a collective, since the peers of a failed rank may be stuck in one.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

PROBE_PREFIX = ".par3d-probe-"


class RankZeroError(RuntimeError):
    """What rank 0 raised in :func:`on_rank_zero`, raised on every rank (its type's name and message)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def on_rank_zero(work: Callable[[], T], kinds: tuple[type[BaseException], ...] = ()) -> T:
    """``work()`` computed on rank 0 and its value sent to every rank; where it raises, every rank raises: an error
    of one of ``kinds`` as that type with its message, any other as :class:`RankZeroError`. Without a process
    group, ``work()`` itself. Every rank must call it."""
    if not dist.is_initialized():
        return work()
    outcome: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = work()
        except Exception as error:
            outcome[1] = (type(error).__name__, str(error))
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        kind, message = outcome[1]
        known = next((k for k in kinds if k.__name__ == kind), None)
        raise known(message) if known is not None else RankZeroError(kind, f"on rank 0 ({kind}): {message}")
    return outcome[0]


def on_rank_zero_for_long(work: Callable[[], T], key: str, wait_s: float) -> T:
    """``work()`` computed on rank 0 and its value sent to every rank through the default group's key-value store
    under ``key`` (new for each call), where the other ranks wait up to ``wait_s``: for a step that may take longer
    than the collectives' timeout, which a collective's wait would turn into a timeout on every other rank. What
    ``work`` raises on rank 0 is rank 0's (its peers then time out on the store). Without a process group,
    ``work()``."""
    import pickle

    from lightning_par3d.utils.torch_private import default_store

    if not dist.is_initialized():
        return work()
    store = default_store()
    if dist.get_rank() == 0:
        value = work()
        store.set(key, pickle.dumps(value))
        return value
    store.wait([key], timedelta(seconds=wait_s))
    return pickle.loads(store.get(key))  # the job's own rank 0 wrote it, as broadcast_object_list would send it


def check_directory_is_shared(directory: Path, devices_per_node: int) -> None:
    """Raises ``ValueError`` on every rank where some node does not see ``directory`` as rank 0 does: rank 0 writes
    a probe file there, every rank looks for it, and the ranks that do not see it are named by node. Does nothing
    on one node (every rank sees the same disks) or without a process group. Every rank must call it.

    par3d's checkpoints are one directory that every rank writes its shards into and rank 0 renames into place; on
    a node-local disk each node holds only its own ranks' shards, and that is found only at the next load."""
    if not dist.is_initialized() or dist.get_world_size() <= devices_per_node:
        return
    token = uuid.uuid4().hex

    def write_probe() -> str:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{PROBE_PREFIX}{token}"
        probe.write_text(token)
        return probe.name

    probe = directory / on_rank_zero(write_probe)  # each rank looks in the directory as it sees it
    try:
        seen = probe.is_file() and probe.read_text() == probe.name.removeprefix(PROBE_PREFIX)
    except OSError:
        seen = False
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seen, socket.gethostname()))
    if dist.get_rank() == 0:
        with contextlib.suppress(OSError):
            probe.unlink()
    blind = sorted({(rank // devices_per_node, host) for rank, (ok, host) in enumerate(everyone) if not ok})
    if blind:
        nodes = ", ".join(f"node {node} ({host})" for node, host in blind)
        raise ValueError(
            f"The checkpoint directory {directory} is not shared by every node: {nodes} cannot see the file rank 0 "
            f"wrote there ({probe.name}). par3d's checkpoints are one directory every rank writes its shards into, "
            "so on node-local disks each node would hold part of every checkpoint, and no checkpoint could be "
            "loaded. Put the checkpoints on storage every node mounts at the same path (a shared filesystem), e.g. "
            "ModelCheckpoint(dirpath=...) or the path you save to."
        )


def same_refusal(name: str, rank: int, world_size: int, error: BaseException | None, wait_s: float) -> bool:
    """Whether every rank raised the same ``error`` at step ``name`` (each rank calls it after the step, with its
    error or None), decided through the default group's key-value store: True only where every rank reported the
    same exception type and message within ``wait_s`` of this rank's report. A rank that succeeded returns False
    at once; a rank that failed waits for the others' reports (peers stuck in a collective its failure left
    unfinished never report, and it returns False after ``wait_s``)."""
    from lightning_par3d.utils.torch_private import default_store

    text = "" if error is None else f"{type(error).__name__}: {error}"
    store = default_store()
    store.set(f"{name}/{rank}", text or "ok")
    if error is None:
        return False
    keys = [f"{name}/{r}" for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if store.check(keys):
            return all(store.get(key).decode() == text for key in keys)
        with contextlib.suppress(Exception):
            store.wait(keys, timedelta(seconds=min(1.0, max(deadline - time.monotonic(), 0.01))))
    return False
