"""Starting launchers as separate "nodes" on this machine, for the multi-node and elastic tests: each agent (or
each SLURM task) in a session of its own, its output in ``folder/out<i>.txt``, killed with its process group when it
overstays."""

from __future__ import annotations

import os
import random
import socket
import subprocess
from pathlib import Path

from tests import background

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600


_LOWEST_PORT = 10000


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (32768 on Linux unless changed)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nobody listens on, for a job's ``MASTER_PORT``, drawn at random from *below* the kernel's ephemeral
    range. A port the kernel hands out for ``bind(0)`` comes from that range, so between this call and the job's
    TCPStore binding it, any process's outgoing connection may take it (a CI run failed so, with EADDRINUSE); a port
    below the range is taken only by a listener, and drawing at random keeps concurrent tests apart."""
    top = _ephemeral_start()
    draw = random.SystemRandom()
    for _ in range(200) if top - _LOWEST_PORT >= 1000 else ():
        port = draw.randrange(_LOWEST_PORT, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:  # an unusual range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
