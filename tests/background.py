"""Subprocess cases that run in the background while the pooled tests run, and are checked at the end.

The suite is CPU-bound on a small machine, but the pooled jobs leave a core idle now and then (ranks waiting on each
other, the single-process references). The cases that launch their own process trees (the fault trees, the Hydra
app, a user's script) need no pool, so they start when the session starts, one at a time in a thread of the pytest
process, at a lower CPU priority (:data:`NICE`): they take the CPU the pooled jobs leave, and the pooled jobs, some
of which time their own steps, keep their share. The tests that check them run last
(``conftest.pytest_collection_modifyitems``) and wait for their results.

A case is a fixture made by :func:`fixture`: a test that asks for it gets the case's result, and the session starts
the case at its first test if any selected test asks for it. :func:`run` is ``subprocess.run`` for such cases:
its own session (process group), at the background priority, killed with its whole group at a timeout or when the
session ends. :func:`run_script` and :func:`start_script` do the same for ``python script.py`` as a fork of the
preloaded server (``tests/preloaded.py``), which saves the script's imports.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests import preloaded

NICE = 10
"""The background's niceness. CFS weighs a nice-10 process at 110 against a pooled rank's 1024: the background runs
on the cores the pool leaves idle, and where both want the CPU, a dozen background processes weigh about as much as
one rank together. The pooled jobs slow down while the background runs (that is the point: nothing idles), but
nothing is starved for long: a fault tree's collectives wait at most 20 s for a peer."""

URGENT_NICE = -10
"""The niceness of a case that is timing something a user would see (a fault tree from its fault to its end): ahead
of the pooled ranks, so that what it measures is the code's own time, not the share of a machine that the suite
oversubscribes tenfold. It lasts seconds, mostly spent asleep in a timeout."""

_CASES: dict[str, tuple[int, Callable[[Path], Any]]] = {}
_STARTED: dict[str, Future] = {}
_GROUPS: set[int] = set()  # process groups still running, killed when the session ends
_LOCK = threading.Lock()
_EXECUTOR = ThreadPoolExecutor(
    max_workers=int(os.environ.get("PAR3D_BG_WORKERS", "3")), thread_name_prefix="background"
)


def fixture(name: str, case: Callable[[Path], Any], order: int = 1) -> Any:
    """A module-level fixture called ``name`` whose value is ``case(folder)``, run in the background from the start
    of the session (``folder`` is a fresh temporary directory); cases of lower ``order`` start first. Assign it to
    ``name`` in the test module."""
    _CASES[name] = (order, case)

    @pytest.fixture(scope="session", name=name)
    def _result(tmp_path_factory: pytest.TempPathFactory) -> Any:
        return start(name, tmp_path_factory).result()

    return _result


def names() -> list[str]:
    """The cases' names, in the order they start."""
    return sorted(_CASES, key=lambda name: _CASES[name][0])


def start(name: str, tmp_path_factory: pytest.TempPathFactory) -> Future:
    """Starts the case ``name`` unless it has started; its future."""
    with _LOCK:
        if name not in _STARTED:
            folder = tmp_path_factory.mktemp(name.replace("/", "-"))
            _STARTED[name] = _EXECUTOR.submit(_CASES[name][1], folder)
        return _STARTED[name]


def can_raise_priority() -> bool:
    """Whether this process may give a child back the normal priority after lowering it (root, or RLIMIT_NICE)."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def lower_priority(group: int) -> None:
    """Gives every thread of the process group the background priority, where a raise back is allowed (else the
    group keeps the normal priority: a case that measures its own timing must not be starved)."""
    if can_raise_priority():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.setpriority(os.PRIO_PGRP, group, NICE)


def raise_priority(group: int) -> None:
    """Gives every thread of the process group :data:`URGENT_NICE`, where allowed (else the normal priority, which
    a group that was never lowered has anyway)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpriority(os.PRIO_PGRP, group, URGENT_NICE if can_raise_priority() else 0)


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session, at the background priority, killed at the session's end if alive."""
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    lower_priority(proc.pid)
    with _LOCK:
        _GROUPS.add(proc.pid)
    return proc


def forget(proc: subprocess.Popen | preloaded.Process) -> None:
    with _LOCK:
        _GROUPS.discard(proc.pid)


def start_script(
    argv: list[str], cwd: Path, stdout: Path, stderr: Path, env: dict[str, str] | None = None
) -> preloaded.Process:
    """``python *argv`` as a fork of the preloaded server (``tests/preloaded.py``), in a new session, at the
    background priority, killed at the session's end if alive."""
    proc = preloaded.Process(argv, cwd, stdout, stderr, env, nice=NICE if can_raise_priority() else 0)
    with _LOCK:
        _GROUPS.add(proc.pid)
    return proc


def run(args: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)`` in the background: on a timeout the
    whole process group is killed and ``TimeoutExpired`` raised."""
    proc = popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        forget(proc)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def run_script(
    argv: list[str], timeout: float, cwd: Path, output: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """:func:`run` for ``python *argv``, forked from the preloaded server: stdout and stderr go to files in
    ``output`` and come back as text. Processes of the job still running 30 s after it ended are killed, and that
    fails the case."""
    stdout, stderr = output / "stdout.txt", output / "stderr.txt"
    proc = start_script(argv, cwd, stdout, stderr, env)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        raise
    finally:
        forget(proc)
    read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
    if not _group_ends(proc.pid, within_s=30):
        raise AssertionError(f"{argv}: processes of the job outlived it by 30 s (killed).\n{read(stderr)[-3000:]}")
    return subprocess.CompletedProcess(argv, code, read(stdout), read(stderr))


def _group_ends(group: int, within_s: float) -> bool:
    """Whether every process of the group has ended within ``within_s``; if not, they are killed."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _group_alive(group):
            return True
        time.sleep(0.1)
    kill_group(group)
    return False


def _group_alive(group: int) -> bool:
    """Whether a process of the group is still running (zombies, ended but not yet reaped, do not count)."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, pgrp, ...
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


def kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def stop() -> None:
    """At the session's end: kills what is still running (an interrupted session) and drops the threads."""
    with _LOCK:
        groups = list(_GROUPS)
        _GROUPS.clear()
    for group in groups:
        kill_group(group)
    _EXECUTOR.shutdown(wait=False, cancel_futures=True)
    preloaded.close()
