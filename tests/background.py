"""Process-tree cases: tests whose job is a command line (the fault script, the Hydra app, a user's script) that
starts real interpreters, as a user's job does. They need no pool, so they run in the background of the session.

A case is a fixture made by :func:`fixture`. When the session starts, ``conftest._background_cases`` starts every case
that a selected test asks for (only those: ``pytest tests/test_cli.py::test_unknown_mode_is_a_clear_error`` runs one
command), on :data:`WORKERS` threads of the pytest process, cases of lower ``order`` first; a test that asks for a
case gets its result, waiting for it if need be. Those tests run last (``conftest.pytest_collection_modifyitems``),
so the cases have the whole session to run beside the pooled tests.

Every command runs in a session (process group) of its own, at niceness :data:`NICE` (where this process may raise it
back: root, or ``RLIMIT_NICE``): it takes the CPU the pooled jobs leave idle, and the pooled jobs, some of which time
their own steps, keep their share. Whatever is still running at the end of the pytest session is killed.

Environment: ``PAR3D_BG_WORKERS`` (default 2), how many cases run at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

WORKERS = int(os.environ.get("PAR3D_BG_WORKERS", "2"))
"""How many cases run at once (``PAR3D_BG_WORKERS``)."""
NICE = 10
"""The background's niceness, of its processes and of its session (:func:`set_priority`). CFS weighs a nice-10
session at 110 against the pytest session's 1024, all pooled ranks together: the background runs on the cores the
pool leaves idle, and takes about a tenth of them where both want the CPU."""
URGENT_NICE = -10
"""The niceness of a case while it times something a user would see (a fault tree from its fault to its end): ahead
of the pooled ranks, so that what it measures is the code's own time, not a share of a machine that the suite
oversubscribes."""
LEFT_BEHIND_S = 30
"""How long the processes of a command may outlive it (its first process) before they count as left behind."""


@dataclass(frozen=True)
class _Case:
    run: Callable[..., Any]
    order: int
    ident: Callable[[Any], str] | None  # a parametrized case's id of a parameter


_CASES: dict[str, _Case] = {}
_STARTED: dict[str, Future] = {}
_GROUPS: set[int] = set()  # process groups still running, killed when the session ends
_LOCK = threading.Lock()
_EXECUTOR = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="background")


def fixture(
    name: str,
    case: Callable[..., Any],
    order: int = 1,
    params: Sequence[Any] | None = None,
    ids: Callable[[Any], str] = str,
) -> Any:
    """A fixture called ``name`` (assign it to ``name`` in the test module) whose value is ``case(folder)``, or with
    ``params``, one ``case(folder, param)`` per parameter (test ids from ``ids``). ``folder`` is a fresh temporary
    directory. Each case runs once per session, however many tests ask for it."""
    _CASES[name] = _Case(case, order, ids if params is not None else None)

    @pytest.fixture(name=name, params=params, ids=ids if params is not None else None)
    def _result(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
        return start(name, getattr(request, "param", None), tmp_path_factory).result()

    return _result


def cases_of(item: pytest.Item) -> list[tuple[int, str, Any]]:
    """The cases a test asks for: ``(order, name, parameter)`` each (the parameter is None for a plain case)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    fixtures = getattr(item, "fixturenames", ())
    return [(_CASES[name].order, name, params.get(name)) for name in fixtures if name in _CASES]


def start(name: str, param: Any, tmp_path_factory: pytest.TempPathFactory) -> Future:
    """Starts the case (``name``, and ``param`` if it is parametrized) unless it has started; its future."""
    case = _CASES[name]
    key = name if case.ident is None else f"{name}[{case.ident(param)}]"
    with _LOCK:
        if key not in _STARTED:
            folder = tmp_path_factory.mktemp(re.sub(r"[^\w.-]+", "-", key))
            args = (folder,) if case.ident is None else (folder, param)
            _STARTED[key] = _EXECUTOR.submit(case.run, *args)
        return _STARTED[key]


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a new session, at the background priority, killed at the session's end if alive.
    The processes it starts stay in its process group (Lightning's launcher does not start sessions)."""
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    if can_raise_priority():  # else the group keeps the normal priority: a case that times itself must not starve
        set_priority(proc.pid, NICE)
    with _LOCK:
        _GROUPS.add(proc.pid)
    return proc


def run(args: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)`` through :func:`popen`: on
    a timeout the whole process group is killed and ``TimeoutExpired`` raised. Processes of the group still running
    :data:`LEFT_BEHIND_S` after the command ended are killed, and raise ``AssertionError``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # files: a rank left behind cannot block
        proc = popen(args, stdout=out, stderr=err, **kwargs)
        try:
            proc.wait(timeout=timeout)
            ended = group_ends(proc.pid, within_s=LEFT_BEHIND_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            forget(proc.pid)
        stdout, stderr = _read(out), _read(err)
    if not ended:
        raise AssertionError(f"{args}: processes outlived the command by {LEFT_BEHIND_S} s (killed).\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def _read(file: Any) -> str:
    file.seek(0)
    return file.read().decode(errors="replace")


def can_raise_priority() -> bool:
    """Whether this process may give a child back the normal priority after lowering it (root, or RLIMIT_NICE)."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def set_priority(group: int, nice: int) -> None:
    """Gives every thread of every process in the group the niceness ``nice``, where allowed, and so the group's
    session (each case runs in a session of its own: ``group`` is its id) where the kernel schedules by session.

    With autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by default in most distributions'
    kernels), CFS first shares the CPU between sessions, each weighing as a nice-0 process whatever its processes'
    niceness, and a niceness counts only within its session. A case's niceness alone would then be ignored, and
    every case would weigh as much as the whole pytest session, all pooled ranks together (measured here: two
    nice-10 processes in sessions of their own got twice the CPU of two nice-0 ones in one session). The session's
    own niceness (``/proc/<pid>/autogroup``) is what the kernel weighs between sessions."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.setpriority(os.PRIO_PGRP, group, nice)
    for member in [group, *group_members(group)]:
        with contextlib.suppress(OSError):
            Path(f"/proc/{member}/autogroup").write_text(str(nice))
            return


def group_members(group: int) -> list[int]:
    """The processes of the group still running (zombies, ended but not yet reaped, do not count)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, pgrp, ...
            if int(fields[2]) == group and fields[0] != "Z":
                members.append(int(stat.parent.name))
    return members


def group_ends(group: int, within_s: float) -> bool:
    """Whether every process of the group ends within ``within_s``; if not, they are killed."""
    deadline = time.monotonic() + within_s
    while group_members(group):
        if time.monotonic() > deadline:
            kill_group(group)
            return False
        time.sleep(0.1)
    return True


def kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


def forget(group: int) -> None:
    """The group has ended: it is no longer killed at the session's end."""
    with _LOCK:
        _GROUPS.discard(group)


def stop() -> None:
    """At the session's end: kills what is still running (an interrupted session) and drops the threads."""
    with _LOCK:
        groups = list(_GROUPS)
        _GROUPS.clear()
    for group in groups:
        kill_group(group)
    _EXECUTOR.shutdown(wait=False, cancel_futures=True)
