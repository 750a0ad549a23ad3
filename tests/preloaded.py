"""Runs a script as ``python script.py args`` would, but as a fork of a server that has imported torch and
Lightning once: the suite's subprocess cases start dozens of such processes, and on a small machine each would
otherwise spend about 6 s of CPU importing before it does anything.

The server (``python tests/preloaded.py``, started on first use) reads one request per line on stdin and forks a
child per request. The child starts a new session (its PID is its process group), points stdin at ``/dev/null`` and
stdout/stderr at the requested files, takes the requested working directory, environment and ``sys.argv``, and runs
the script as ``__main__`` (``runpy``), so ``__main__.__file__`` and ``sys.argv`` are what a launcher re-executes.
It then leaves through the interpreter's normal exit, atexit handlers included, with the script's exit code. The
server reaps its children and reports each one's exit code and when it ended (:func:`ended_at`); it stays
single-threaded, so forking it is safe.

**The ranks a child launches.** Lightning's subprocess launcher starts the other ranks as
``[sys.executable, script, *args]``: fresh interpreters, each importing Lightning anew. In a child,
``sys.executable`` is a stand-in (:func:`_write_stand_in`) that runs ``python script.py args`` as another fork of the
server, with the stand-in's own stdin, stdout, stderr (passed over a Unix socket), working directory, environment
and niceness; anything else (``python -c``, ``python -m``) it hands to the real interpreter. The stand-in stays
for as long as the fork runs and is its handle for the launcher: it forwards the signals a process can catch, exits
with the fork's exit code (or dies of the same signal), and when the stand-in is killed (``SIGKILL``: Lightning's
launcher ending the job), the fork kills itself at once. The fork runs in its own session, so
``tests.background.raise_priority`` takes the PIDs the ranks write as well as the launcher's group.

:class:`Process` is the caller's handle, shaped like ``subprocess.Popen``: ``pid``, ``poll``, ``wait``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXTRA_PRELOAD = ["hydra", "examples.data"]
"""What the server imports besides the test pool's own preload (``tests.harness.PRELOAD``): the Hydra app's and the
fault script's other imports."""
SOCKET_ENV = "PAR3D_PRELOADED_SOCKET"
"""The environment variable that tells a stand-in where the server listens (set in every child's environment)."""
CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# ------------------------------------------------------------------------------------------------------- server
def _serve() -> None:
    path = list(sys.path[1:])  # the interpreter's own path, without this file's folder
    sys.path.insert(0, str(ROOT))
    from tests.harness import PRELOAD

    for name in [*PRELOAD, *EXTRA_PRELOAD]:
        __import__(name)
    sys.path[:] = path
    folder, server = tempfile.mkdtemp(prefix="par3d-preloaded-"), os.getpid()
    try:
        _serve_in(_Forks(folder))
    finally:  # the caller has gone (the session's end): its socket and stand-in go too; never in a fork, which
        if os.getpid() == server:  # leaves through here as well (the script's SystemExit)
            shutil.rmtree(folder, ignore_errors=True)


def _serve_in(forks: _Forks) -> None:
    print(json.dumps({"ready": True}), flush=True)
    buffered = b""
    while True:
        readable, _, _ = select.select([0, forks.listener.fileno(), *forks.pending], [], [], 0.05)
        if 0 in readable:
            chunk = os.read(0, 65536)
            if not chunk:  # the caller has gone: leave the children to their sessions
                return
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                _reply({"id": request["id"], "pid": forks.fork(request)})
        if forks.listener.fileno() in readable:
            connection, _ = forks.listener.accept()
            forks.pending[connection.fileno()] = _Pending(connection)
        for fd in set(readable) & set(forks.pending):
            forks.read(fd)
        forks.reap()


class _Forks:
    """The server's children: those the caller asked for and the stand-ins' (whose exit codes also go back on the
    stand-in's connection). Every child's end, with its exit code and time, is reported on stdout."""

    def __init__(self, folder: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(os.path.join(folder, "socket"))
        self.listener.listen(64)
        self.stand_in = _write_stand_in(folder)
        self.children: dict[int, socket.socket | None] = {}
        self.pending: dict[int, _Pending] = {}
        """Stand-ins' requests still arriving, by their connection's descriptor: read as they come, so that the
        server never waits on one (a stand-in at the background priority may be slow to send)."""

    def fork(self, request: dict[str, Any], connection: socket.socket | None = None) -> int:
        request["env"] = {**request["env"], SOCKET_ENV: self.listener.getsockname()}
        pid = os.fork()
        if pid == 0:
            others = [p.connection for p in self.pending.values()]
            for sock in [self.listener, *filter(None, self.children.values()), *others, connection]:
                if sock is not None:
                    sock.close()
            _child(request, self.stand_in)  # never returns here: raises SystemExit
        self.children[pid] = connection
        return pid

    def read(self, fd: int) -> None:
        """Reads what a stand-in has sent; once its request (and its stdin, stdout, stderr) is whole, forks its child
        and tells it the child's PID."""
        pending = self.pending[fd]
        try:
            data, fds, _, _ = socket.recv_fds(pending.connection, 1 << 20, 3)
            pending.data += data
            pending.fds += fds
            if not data:
                raise ValueError("a stand-in's request ended early")
            if not pending.data.endswith(b"\n"):
                return
            del self.pending[fd]
            pid = self.fork({**json.loads(pending.data), "fds": pending.fds}, pending.connection)
            pending.connection.sendall((json.dumps({"pid": pid}) + "\n").encode())
        except (OSError, ValueError):  # a stand-in that died or sent nothing: it gets no fork
            self.pending.pop(fd, None)
            pending.connection.close()
        finally:
            if fd not in self.pending:
                for passed in pending.fds:
                    os.close(passed)

    def reap(self) -> None:
        for pid in list(self.children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            code = os.waitstatus_to_exitcode(status)
            connection = self.children.pop(pid)
            _reply({"exit": pid, "code": code, "at": time.time()})
            if connection is None:
                continue
            with contextlib.suppress(OSError):  # the stand-in may have been killed
                connection.sendall((json.dumps({"code": code}) + "\n").encode())
            connection.close()


def _reply(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _child(request: dict[str, Any], stand_in: str) -> None:
    import runpy

    os.setsid()
    if "fds" in request:  # a stand-in's: its own streams
        for fd, passed in enumerate(request["fds"]):
            os.dup2(passed, fd)
        _die_with(request["stand_in"])
    else:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, request.get("nice", 0))
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.executable = stand_in
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as ``python script.py`` does
    code: Any = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)


def _die_with(stand_in: int) -> None:
    """Kills this process the moment the stand-in ``stand_in`` ends (it outlives this process unless killed)."""
    try:
        handle = os.pidfd_open(stand_in)
    except (AttributeError, OSError):  # no pidfd (an old kernel): poll for the PID instead
        handle = None
        if not _alive(stand_in):
            os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while _alive(stand_in):
                threading.Event().wait(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="preloaded-stand-in-watch").start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _write_stand_in(folder: str) -> str:
    """An executable ``python`` in ``folder`` that runs this file's :func:`_stand_in` on the real interpreter,
    without the site packages (``-I -S``: it imports nothing but the standard library, in milliseconds)."""
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec '{sys.executable}' -I -S '{__file__}' --stand-in \"$@\"\n")
    os.chmod(path, 0o755)
    return path


@dataclass
class _Pending:
    connection: socket.socket
    data: bytes = b""
    fds: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------- stand-in
def _stand_in(argv: list[str]) -> None:
    """``python *argv``: a script as a fork of the server (see the module's docstring); anything else runs on the
    real interpreter."""
    if not argv or argv[0].startswith("-") or SOCKET_ENV not in os.environ:
        os.execv(sys.executable, [sys.executable, *argv])
    request = dict(
        argv=argv,
        cwd=os.getcwd(),
        env=dict(os.environ),
        stand_in=os.getpid(),
        nice=os.getpriority(os.PRIO_PROCESS, 0),
    )
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(os.environ[SOCKET_ENV])
    socket.send_fds(connection, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
    replies = connection.makefile("rb")
    child = json.loads(replies.readline())["pid"]
    for caught in CAUGHT:
        signal.signal(caught, lambda received, _: os.kill(child, received))
    line = replies.readline()
    code = json.loads(line)["code"] if line else -int(signal.SIGKILL)
    if code < 0:  # the fork died of a signal: so does its stand-in
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


# ------------------------------------------------------------------------------------------------------- client
class _Server:
    """The caller's side: one server per pytest process, its replies read by one thread."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True
        )
        assert self._proc.stdout is not None
        ready = self._proc.stdout.readline()
        if not ready:
            raise RuntimeError("the preloaded server did not start")
        self._changed = threading.Condition()
        self._pids: dict[int, int] = {}
        self._codes: dict[int, int] = {}
        self._ended_at: dict[int, float] = {}
        self._next = 0
        self._closed = False
        threading.Thread(target=self._read, daemon=True, name="preloaded-replies").start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "pid" in message:
                    self._pids[message["id"]] = message["pid"]
                else:
                    self._codes[message["exit"]] = message["code"]
                    self._ended_at[message["exit"]] = message["at"]
                self._changed.notify_all()

    def start(self, request: dict[str, Any]) -> int:
        assert self._proc.stdin is not None
        with self._changed:
            self._next += 1
            ident = self._next
            self._proc.stdin.write((json.dumps({**request, "id": ident}) + "\n").encode())
            self._proc.stdin.flush()
            if not self._changed.wait_for(lambda: ident in self._pids, timeout=60):
                raise RuntimeError(f"the preloaded server did not start {request['argv']} within 60 s")
            return self._pids.pop(ident)

    def code(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self._closed, timeout=timeout)
            return self._codes.get(pid, -9 if self._closed else None)

    def ended_at(self, pid: int) -> float | None:
        with self._changed:
            return self._ended_at.get(pid)

    def close(self) -> None:
        """Ends the server; a child it has not reported is then taken as killed (the session's end kills them)."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=10)
        with self._changed:
            self._closed = True
            self._changed.notify_all()


_SERVER: _Server | None = None
_SERVER_LOCK = threading.Lock()


def _server() -> _Server:
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = _Server()
        return _SERVER


class Process:
    """``python *argv`` as a fork of the preloaded server, in a new session, with stdout and stderr in files."""

    def __init__(
        self, argv: list[str], cwd: Path, stdout: Path, stderr: Path, env: dict[str, str] | None = None, nice: int = 0
    ) -> None:
        request = dict(
            argv=[str(a) for a in argv],
            cwd=str(cwd),
            stdout=str(stdout),
            stderr=str(stderr),
            env=dict(os.environ if env is None else env),
            nice=nice,
        )
        self.pid = _server().start(request)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _server().code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = _server().code(self.pid, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        self.returncode = code
        return code


def ended_at(pid: int) -> float | None:
    """When a child of the server ended (``time.time()``, as the server reaped it): a script it started, or a rank
    started through its stand-in ``python``; None while it runs, or for a PID that is not the server's child."""
    return _server().ended_at(pid)


def close() -> None:
    """Ends the server (at the session's end); children already started keep running in their own sessions."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is not None:
            _SERVER.close()
            _SERVER = None


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stand-in"]:
        _stand_in(sys.argv[2:])
    else:
        _serve()
