"""One function call in a fresh ``python``: for work that needs a process of its own, such as torch's fake process
group (which must be the process's default group) in a process that already has a real one.

:func:`call` pickles the function and its arguments with ``cloudpickle`` into a request file, has them run in a
process that shares nothing of the caller's torch state (no process group, DTensor cache or thread), and returns what
the function returned, or raises what it raised (the same exception type, with the child's traceback as a note).

**Where the call runs.** On Linux, in a fork of a *clean server*: an interpreter (``python -m
lightning_par3d.utils.fresh_interpreter --serve``) that the caller starts at its first call, which imports torch,
par3d's engine and, where the caller has them, Lightning and transformers, and then does nothing but fork one child
per call. The server never runs torch code, starts no process group and initialises no GPU, so each child begins as
a fresh interpreter would, less the imports (about 6 s of CPU on a small machine, and most of a call's cost: a dry run
of a pipeline runs one call per stage). The server lives as long as the caller (it ends with it) and is started again
if it died. Elsewhere (macOS, Windows: no safe ``fork``), each call runs ``python -m
lightning_par3d.utils.fresh_interpreter REQUEST RESULT``.

A class defined in the script being run (``__main__``, the usual place for a training script's LightningModule) or
inside a function travels by value; a class of an importable module by name (the child gets the caller's
``sys.path``, environment and working directory, so a module the caller imported from its working directory is
found). The script itself is never run again.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT")
"""Left out of the child's environment: it is no rank of the caller's job."""
_STDERR_LINES = 20
"""The child's last lines of error output repeated in the error raised when it ends without a result."""
_MODULE = "lightning_par3d.utils.fresh_interpreter"
_PRELOAD = ("torch", "torch.distributed.tensor", "cloudpickle", "lightning_par3d.engine")
"""What the server imports for every call."""
_PRELOAD_IF_LOADED = ("lightning", "transformers")
"""What the server imports too where the caller has imported it: what a LightningModule or a transformers model
sent to the child would import there (the heaviest imports of all)."""


def call(fn: Callable[..., Any], *args: Any, what: str = "the call", timeout_s: float = 600.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` computed in a fresh interpreter (see the module docstring). ``what`` names the work
    in errors. Raises ``RuntimeError`` when the arguments cannot be pickled, when the child ends without a result,
    and after ``timeout_s`` (the child is then killed); an exception ``fn`` raised is raised again here."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise RuntimeError(f"{what}: its arguments cannot be pickled for a fresh interpreter ({err})") from err
    with tempfile.TemporaryDirectory(prefix="par3d-fresh-") as folder:
        request, result, log = Path(folder, "request.pkl"), Path(folder, "result.pkl"), Path(folder, "output.txt")
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        # par3d itself is found where this process found it, the folder holding lightning_par3d/ (the rest of
        # sys.path comes with the request); never lightning_par3d/ itself, whose modules would shadow top-level ones.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
        ask = {"sys_path": list(sys.path), "payload": payload, "cwd": os.getcwd()}
        code = _run(request, ask, result, log, env, timeout_s, what)
        if not result.exists():
            output = log.read_text(errors="replace") if log.exists() else ""
            tail = "\n".join(output.strip().splitlines()[-_STDERR_LINES:])
            raise RuntimeError(f"{what}: its interpreter exited with code {code} and no result:\n{tail}")
        ok, value, trace = pickle.loads(result.read_bytes())
    if ok:
        return value
    if isinstance(value, BaseException):
        value.add_note(f"(raised in the fresh interpreter of {what}:\n{trace.rstrip()})")
        raise value
    raise RuntimeError(f"{what} failed:\n{trace}")


def _run(
    request: Path, ask: dict[str, Any], result: Path, log: Path, env: dict[str, str], timeout_s: float, what: str
) -> int:
    """Runs the request ``ask`` in a fork of the clean server (Linux) or a new interpreter; the child's exit code.
    The child gets ``env`` from its process (the server's environment, or the new interpreter's); the request file
    carries only what differs from that (:func:`_write_request`)."""
    if sys.platform.startswith("linux"):
        with _LOCK:  # one call at a time per server
            for attempt in range(2):
                server = _server(env)
                _write_request(request, ask, server.env, env)
                try:
                    return server.run(request, result, log, timeout_s, what)
                except _ServerGone:
                    server.stop()
                    if attempt:
                        raise RuntimeError(f"{what}: the fresh-interpreter server ended unexpectedly") from None
    _write_request(request, ask, env, env)
    command = [sys.executable, "-m", _MODULE, str(request), str(result)]
    with log.open("w") as output:
        try:
            done = subprocess.run(command, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{what} did not finish within {timeout_s:g} s") from err
    return done.returncode


def _write_request(request: Path, ask: dict[str, Any], inherited: dict[str, str], env: dict[str, str]) -> None:
    """Writes the request file, readable by this user only (0600): the call, and of the environment only the
    variables ``env`` sets or unsets beside ``inherited`` (what the child's process starts with), so that no
    environment (tokens, keys) is copied to disk. The child removes it as soon as it has read it."""
    changed = {k: v for k, v in env.items() if inherited.get(k) != v}
    unset = [k for k in inherited if k not in env]
    with contextlib.suppress(FileNotFoundError):
        request.unlink()
    fd = os.open(request, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pickle.dumps({**ask, "env_set": changed, "env_unset": unset}))


# ---------------------------------------------------------------- the caller's side of the server


class _ServerGone(Exception):
    """The server closed its pipe (it was killed, or could not start)."""


class _Server:
    """The clean server this process started, and the pipe to it: a line ``REQUEST RESULT LOG`` (tab-separated)
    asks for a call; the server answers the child's PID, then its exit code, a line each."""

    def __init__(self, preload: tuple[str, ...], env: dict[str, str]) -> None:
        self.owner = os.getpid()
        self.preload = preload
        self.env = dict(env)
        """The environment the server (and so every child it forks) starts with."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", _MODULE, "--serve", *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        self._pending = b""

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def run(self, request: Path, result: Path, log: Path, timeout_s: float, what: str) -> int:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{request}\t{result}\t{log}\n".encode())
            self.proc.stdin.flush()
        except OSError as err:
            raise _ServerGone from err
        try:
            child = int(self._answer(timeout_s))  # waits for the server's imports when it has just started
            try:
                return int(self._answer(timeout_s))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
                self._answer(30.0)  # the server reaps it, and is ready for the next call
        except TimeoutError:
            self.stop()  # an answer it still owes this call would be read as the next call's: a new server serves it
        raise RuntimeError(f"{what} did not finish within {timeout_s:g} s") from None

    def _answer(self, timeout_s: float) -> bytes:
        """The server's next line; ``TimeoutError`` after ``timeout_s``, ``_ServerGone`` if the pipe closed."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise _ServerGone
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def stop(self) -> None:
        """Closes the pipe (the server ends when it reads its end) and waits a little; kills it past that."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        if self.owner != os.getpid():  # a forked copy of the caller: the server is its parent's; drop the copied pipes
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            return
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_LOCK = threading.Lock()
_SERVER: _Server | None = None


def _server(env: dict[str, str]) -> _Server:
    """This process's server, started (or started again) where needed: where none is running, where it died, and
    where the caller has since imported something heavy that it did not preload."""
    global _SERVER
    preload = _PRELOAD + tuple(name for name in _PRELOAD_IF_LOADED if name in sys.modules)
    if _SERVER is not None and _SERVER.alive() and set(preload) <= set(_SERVER.preload):
        return _SERVER
    if _SERVER is not None:
        _SERVER.stop()
    _SERVER = _Server(preload, env)
    return _SERVER


@atexit.register
def stop_server() -> None:
    """Stops this process's server, if it started one (also at the interpreter's exit)."""
    global _SERVER
    if _SERVER is not None:
        _SERVER.stop()
        _SERVER = None


# ---------------------------------------------------------------- the server and the child


def _die_with_parent() -> None:
    """SIGKILL this process when its parent ends (Linux), so that neither a server nor a child outlives its caller."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(preload: list[str]) -> None:
    """The server: imports ``preload``, then for each request line forks a child that runs it, and answers the
    child's PID and exit code. It runs nothing else, so that a fork of it is as clean as a new interpreter."""
    _die_with_parent()  # (of the caller's thread that started it: a server that died is started again)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the caller's to handle
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever an import prints cannot garble the answers
    for name in preload:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    for line in sys.stdin:
        request, result, log = line.rstrip("\n").split("\t")
        child = os.fork()
        if child == 0:
            answers.close()  # only the server answers: the caller sees the pipe close when the server ends
            _child(request, result, log)
        answers.write(f"{child}\n")
        answers.flush()
        _, status = os.waitpid(child, 0)
        answers.write(f"{os.waitstatus_to_exitcode(status)}\n")
        answers.flush()


def _child(request: str, result: str, log: str) -> None:
    """A fork of the server: its output to ``log``, the request run, and ``os._exit`` (nothing of the server's
    exit runs here)."""
    code = 1
    try:
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout = sys.stderr = os.fdopen(os.dup(1), "w", buffering=1)
        import random

        random.seed()  # not the sequence every other fork of the server would draw
        _main(request, result)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


def _main(request_path: str, result_path: str) -> None:
    """The child: reads the request, takes the caller's environment, puts the caller's ``sys.path`` entries after
    its own, calls the function and writes ``(True, value, "")`` or ``(False, exception, traceback text)``."""
    import cloudpickle

    request = pickle.loads(Path(request_path).read_bytes())
    with contextlib.suppress(OSError):
        os.unlink(request_path)  # read: nothing of the call stays on disk
    for name in request["env_unset"]:
        os.environ.pop(name, None)
    os.environ.update(request["env_set"])
    os.chdir(request["cwd"])
    sys.path.extend(entry for entry in request["sys_path"] if entry not in sys.path)
    try:
        fn, args, kwargs = pickle.loads(request["payload"])
        outcome: tuple[bool, Any, str] = (True, fn(*args, **kwargs), "")
    except Exception as err:
        outcome = (False, err, traceback.format_exc())
    try:
        data = cloudpickle.dumps(outcome)
    except Exception:  # an exception (or a result) that does not pickle: its text
        why = outcome[2] or f"the result of type {type(outcome[1]).__name__} cannot be sent back"
        data = pickle.dumps((False, None, why))
    Path(result_path).write_bytes(data)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2:])
    else:
        _main(*sys.argv[1:3])
