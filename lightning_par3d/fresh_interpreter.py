"""One function call in a fresh ``python``: for work that needs a process of its own, such as torch's fake process
group (which must be the process's default group) in a process that already has a real one.

:func:`call` pickles the function and its arguments with ``cloudpickle`` into a request file, runs ``python -m
lightning_par3d.fresh_interpreter REQUEST RESULT``, and returns what the function returned, or raises what it raised
(the same exception type, with the child's traceback as a note). Nothing of the calling process's torch state is
seen by the child: no process group, DTensor cache or thread.

A class defined in the script being run (``__main__``, the usual place for a training script's LightningModule) or
inside a function travels by value; a class of an importable module by name (the child gets the caller's
``sys.path``, so a module the caller imported from its working directory is found). The script itself is never run
again.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT")
"""Left out of the child's environment: it is no rank of the caller's job."""
_STDERR_LINES = 20
"""The child's last lines of error output repeated in the error raised when it ends without a result."""


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
        request, result = Path(folder, "request.pkl"), Path(folder, "result.pkl")
        request.write_bytes(pickle.dumps({"sys_path": list(sys.path), "payload": payload}))
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        # par3d itself is found where this process found it (the rest of sys.path comes with the request).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "lightning_par3d.fresh_interpreter", str(request), str(result)]
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"{what} did not finish within {timeout_s:.0f} s") from err
        if not result.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-_STDERR_LINES:])
            raise RuntimeError(f"{what}: its interpreter exited with code {done.returncode} and no result:\n{tail}")
        ok, value, trace = pickle.loads(result.read_bytes())
    if ok:
        return value
    if isinstance(value, BaseException):
        value.add_note(f"(raised in the fresh interpreter of {what}:\n{trace.rstrip()})")
        raise value
    raise RuntimeError(f"{what} failed:\n{trace}")


def _main(request_path: str, result_path: str) -> None:
    """The child: reads the request, puts the caller's ``sys.path`` entries after its own, calls the function and
    writes ``(True, value, "")`` or ``(False, exception, traceback text)``."""
    import cloudpickle

    request = pickle.loads(Path(request_path).read_bytes())
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
    _main(*sys.argv[1:3])
