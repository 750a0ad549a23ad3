"""Imported first by the pool's fork server (``tests/harness.py``'s preload), and by nothing else: the server gets
SIGKILL when the process that started it (pytest) ends, however it ends. Python's fork server exits by itself only
when the pipe its parent holds closes, which a pytest killed with SIGKILL, with workers of its own still sharing the
server's descriptors, does not guarantee: measured, a killed pytest's server and both workers of its pool of 2 were
still running minutes later. The workers end with the server (``harness._die_with_parent``)."""

from __future__ import annotations

import signal
import sys

if sys.platform.startswith("linux"):
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
