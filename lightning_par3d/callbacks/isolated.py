"""Running a function in a forked copy of this process, outside its distributed world.

The memory estimator simulates every rank of a layout in one process, over torch's fake process group, which must
be that process's default group; a rank of a real run already has one. A forked child inherits the caller's objects
as they are (nothing is pickled on the way in: a LightningModule whose class lives in the user's script is fine),
forgets the parent's process groups without touching them, runs the function, and sends back its result (pickled:
par3d's own result types). The parent's groups, threads and sockets are not disturbed.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_isolated(fn: Callable[[], T], timeout_s: float = 600.0) -> T:
    """``fn()`` computed in a forked child with no process group; raises ``RuntimeError`` with the child's error.

    The child is made with ``os.fork`` itself, not ``multiprocessing``, so that it works from any process, daemonic
    ones included (a pool worker, a dataloader worker)."""
    if sys.platform == "win32" or not hasattr(os, "fork"):
        raise RuntimeError("needs a platform that can fork (Linux or macOS)")
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork of a process with threads
        pid = os.fork()
    if pid == 0:  # the child
        os.close(read_fd)
        _child(fn, write_fd)
    os.close(write_fd)
    try:
        payload = _read_all(read_fd, timeout_s)
    finally:
        os.close(read_fd)
        _reap(pid)
    if not payload:
        raise RuntimeError("the child process ended without a result")
    ok, value = pickle.loads(payload)
    if not ok:
        raise RuntimeError(value)
    return value


def _read_all(fd: int, timeout_s: float) -> bytes:
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"did not finish within {timeout_s:.0f} s")
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _reap(pid: int) -> None:
    for _ in range(50):
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _child(fn: Callable[[], Any], write_fd: int) -> None:
    try:
        try:
            import torch

            torch.set_num_threads(1)  # the parent's thread pools did not survive the fork
            _forget_process_groups()
            payload = pickle.dumps((True, fn()))
        except BaseException as err:  # report everything to the parent
            payload = pickle.dumps((False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
    finally:
        os._exit(0)  # no atexit, no destructors: the parent's groups must not be shut down from here


_KEPT: list[Any] = []


def _forget_process_groups() -> None:
    """Makes this (forked) process see no process group, without shutting down the parent's: their objects stay
    referenced, so no destructor runs, and the registry of group names is emptied for the fake ones to come."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    c10d = dist.distributed_c10d
    _KEPT.append(c10d._world)
    c10d._world = c10d._World()
    for name in ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag"):
        _KEPT.append(getattr(c10d, name))  # the world's maps are module globals behind _World's properties
        setattr(c10d, name, {})
    c10d._group_count = 0
    c10d._unregister_all_process_groups()
    _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Empties DTensor's caches of sharding decisions and redistribution plans. They are keyed by ``DeviceMesh``
    equality, which ignores process groups, so a mesh built here over fake groups would be served the parent's
    meshes and their groups ("Could not resolve the process group registered under the name …").

    Three kinds: the Python ``lru_cache`` objects of ``torch.distributed`` (the sharding propagator's per-thread
    cache among them), the C++ fast path's sharding cache, and the redistribute planners (keyed by a weak reference
    to the mesh, which compares equal for equal meshes)."""
    import functools
    import gc

    import torch

    with warnings.catch_warnings():  # looking at torch's deprecated aliases (reduce_op) warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            module = str(getattr(obj, "__module__", "")) if isinstance(obj, functools._lru_cache_wrapper) else ""
            if module.startswith("torch.distributed"):
                obj.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:  # a torch without planner caching
        return
    clear_redistribute_planner_cache()
