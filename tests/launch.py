"""Starting launchers as separate "nodes" on this machine, for the multi-node and elastic tests: each agent (or
each SLURM task) in a session of its own, its output in ``folder/out<i>.txt``, killed with its process group when it
overstays."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests import background

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh job: no rank or SLURM variables of an enclosing one."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**env, **extra}


def start(command: list[str], folder: Path, i: int, env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen:
    """``command`` in a session of its own (``background.popen``) in ``cwd``, its output in ``folder/out<i>.txt``."""
    out = (folder / f"out{i}.txt").open("w")
    return background.popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def wait_all(
    procs: dict[int, subprocess.Popen], folder: Path, timeout: float = LAUNCH_TIMEOUT_S
) -> list[tuple[int, str]]:
    """Waits for every process ``i`` (killing every group past the timeout); each one's exit code and output."""
    try:
        for proc in procs.values():
            proc.wait(timeout=timeout)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                background.kill_group(proc.pid)
                proc.wait()
            background.forget(proc.pid)
    return [(proc.returncode, (folder / f"out{i}.txt").read_text(errors="replace")) for i, proc in procs.items()]
