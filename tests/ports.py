"""A free port for a job's ``MASTER_PORT``, for the harness's workers and the tests that launch jobs (imports
nothing of the suite: the pool's workers import the harness)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

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
