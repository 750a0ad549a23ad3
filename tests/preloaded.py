"""Runs a script as ``python script.py args`` would, but as a fork of a server that has imported torch and
Lightning once: the suite's subprocess cases start dozens of such processes, and on a small machine each would
otherwise spend about 6 s of CPU importing before it does anything.

The server (``python tests/preloaded.py``, started on first use) reads one request per line on stdin and forks a
child per request. The child starts a new session (its PID is its process group), points stdin at ``/dev/null`` and
stdout/stderr at the requested files, takes the requested working directory, environment and ``sys.argv``, and runs
the script as ``__main__`` (``runpy``), so ``__main__.__file__`` and ``sys.argv`` are what a launcher re-executes
(Lightning's subprocess launcher starts the other ranks as fresh ``python script.py args`` processes). It then leaves
through the interpreter's normal exit, atexit handlers included, with the script's exit code. The server reaps its
children and reports each exit code; it stays single-threaded, so forking it is safe.

:class:`Process` is the caller's handle, shaped like ``subprocess.Popen``: ``pid``, ``poll``, ``wait``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXTRA_PRELOAD = ["hydra", "examples.data"]
"""What the server imports besides the test pool's own preload (``tests.harness.PRELOAD``): the Hydra app's and the
fault script's other imports."""


# ------------------------------------------------------------------------------------------------------- server
def _serve() -> None:
    path = list(sys.path[1:])  # the interpreter's own path, without this file's folder
    sys.path.insert(0, str(ROOT))
    from tests.harness import PRELOAD

    for name in [*PRELOAD, *EXTRA_PRELOAD]:
        __import__(name)
    sys.path[:] = path
    print(json.dumps({"ready": True}), flush=True)
    children: set[int] = set()
    buffered = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:  # the caller has gone: leave the children to their process groups
                return
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)  # never returns here: raises SystemExit
                children.add(pid)
                _reply({"id": request["id"], "pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _reply(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _child(request: dict[str, Any]) -> None:
    import runpy

    os.setsid()
    if request.get("nice"):
        os.nice(request["nice"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
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


def close() -> None:
    """Ends the server (at the session's end); children already started keep running in their own sessions."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is not None:
            _SERVER.close()
            _SERVER = None


if __name__ == "__main__":
    _serve()
