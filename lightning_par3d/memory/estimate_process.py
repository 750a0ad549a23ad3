"""The memory estimator in a fresh interpreter, for a process that already has a process group.

:func:`~lightning_par3d.memory.estimate.estimate_memory` simulates every rank over torch's fake process group, which
must be its process's default group; a rank of a real run already has one (``MemoryStats`` asks for the estimate at
the end of fit). :func:`estimate_in_fresh_interpreter` therefore runs it in a new ``python -m
lightning_par3d.memory.estimate_process REQUEST RESULT``: the request (the unconfigured LightningModule, the config,
the batch shapes) goes in as a pickle file, the :class:`~lightning_par3d.memory.estimate.MemoryEstimate` comes back
as one. Nothing of the calling process's torch state is touched or copied: no process group, DTensor cache or thread
of the run is seen by the estimator.

The module is pickled with ``cloudpickle``: a class defined in the script being run (``__main__``, the usual place
for a training script's LightningModule) or inside a function travels by value, and a class of an importable
module by name (the child gets the caller's ``sys.path``, so a module the caller imported from its working directory
is found). The script itself is never run again.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT")
"""Left out of the child's environment: it is no rank of the run (the fake group takes its rank as an argument)."""
_STDERR_LINES = 20
"""The child's last lines of error output repeated in the error raised when it fails without a result."""


def estimate_in_fresh_interpreter(
    module: Any,
    config: Any,
    world_size: int,
    batch: Any,
    *,
    precision: str = "32-true",
    optimizer: str = "adamw",
    timeout_s: float = 600.0,
) -> Any:
    """:func:`~lightning_par3d.memory.estimate.estimate_memory` with these arguments, computed in a fresh
    interpreter (``sys.executable -m lightning_par3d.memory.estimate_process``). ``module`` is pickled with
    ``cloudpickle`` (see the module docstring). Raises ``RuntimeError`` with the reason when it cannot be sent, with
    the child's error when the estimate fails, and after ``timeout_s`` (the child is then killed)."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps((module, config, world_size, batch, precision, optimizer))
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        raise RuntimeError(f"the module cannot be pickled for a fresh interpreter ({why})") from err
    with tempfile.TemporaryDirectory(prefix="par3d-estimate-") as folder:
        request, result = Path(folder, "request.pkl"), Path(folder, "result.pkl")
        request.write_bytes(pickle.dumps({"sys_path": list(sys.path), "payload": payload}))
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
        # par3d itself is found where this process found it (the rest of sys.path comes with the request).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "lightning_par3d.memory.estimate_process", str(request), str(result)]
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"the estimate did not finish within {timeout_s:.0f} s") from err
        if not result.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-_STDERR_LINES:])
            raise RuntimeError(f"the estimate's interpreter exited with code {done.returncode} and no result:\n{tail}")
        ok, value = pickle.loads(result.read_bytes())
    if not ok:
        raise RuntimeError(value)
    return value


def _main(request_path: str, result_path: str) -> None:
    """The child: reads the request, puts the caller's ``sys.path`` entries after its own, computes the estimate and
    writes ``(True, estimate)`` or ``(False, error text)``."""
    request = pickle.loads(Path(request_path).read_bytes())
    sys.path.extend(entry for entry in request["sys_path"] if entry not in sys.path)
    try:
        from lightning_par3d.memory.estimate import estimate_memory

        module, config, world_size, batch, precision, optimizer = pickle.loads(request["payload"])
        outcome: tuple[bool, Any] = (
            True,
            estimate_memory(module, config, world_size, batch, precision=precision, optimizer=optimizer),
        )
    except Exception as err:
        outcome = (False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    Path(result_path).write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
