"""A pool of real gloo processes that one start serves for many test cases (``conftest.pool2``, ``pool4``, ``pool8``).

Starting a process group costs 10–20 s on a small machine, so a :class:`DistPool` starts ``world_size`` processes
once per session and then runs one job after another in all of them: ``pool.run(fn, **kwargs)`` calls the
module-level function ``fn(**kwargs)`` on every rank and returns the results by rank. Each worker looks like a rank
launched by torchrun (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``LOCAL_WORLD_SIZE``), so
``Trainer(strategy="par3d")`` and ``Fabric(strategy="par3d")`` inside a job take the externally-launched path, and the
first job's process group serves all later jobs.

* **Deadlines.** A job that fails on some ranks only, or misses its deadline, leaves the process group in an unknown
  state: the pool is killed and the next job starts a fresh one.
* **Recycling.** So is a pool whose workers hold more than :data:`RECYCLE_THREADS` threads after a job.
* **Nothing carries over.** The environment, torch's thread count and ``sys.stdout``/``sys.stderr`` are restored
  before each job.
* **Logs.** Each rank's output goes to ``$TMPDIR/par3d-pool<world size>-*/rank<r>.log`` (a line per job, and the
  thread count after it); a failure reports the tail of the failing rank's log and the log's path, and a job past
  its deadline the tail of the first missing rank's log, which ends with the stack of each of its threads where it
  hangs (its ``faulthandler``, on SIGUSR1).

Environment (read when a pool starts):

* ``PAR3D_TEST_START`` — ``forkserver`` (default, where the platform has it): workers are forks of a server that has
  imported :data:`PRELOAD` once; ``spawn``: each worker is a fresh interpreter (slower; for debugging the preload).
* ``PAR3D_TEST_THREADS`` — ``1`` (default): each rank gets ``cores // world_size`` torch threads and that number in
  ``OMP_NUM_THREADS``, as torchrun gives; ``0``: torch's default thread count (every core per rank).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests.ports import free_port

RECYCLE_THREADS = 64
"""A worker past this many OS threads is recycled after its job: every gloo group has a transport thread that wakes
every 10 ms, idle or not, so threads that pile up (a job that makes its own groups) burn CPU while the worker waits.
par3d's own groups do not pile up (one per set of ranks, :mod:`lightning_par3d.distributed.groups`): a 4-rank worker
that has trained at every layout of the suite holds about 20 threads. Starting afresh costs 10 s of CPU or more (the
process group, the first DTensor ops), so a recycle is rare by design."""

PRELOAD = [
    "tests.forkserver_guard",  # first: the server dies with the process that started it
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "lightning",
    "torchmetrics",
    "pytest",
    "lightning_par3d",
    "examples.gpt",
    "tests.gpt_runs",
]
"""What the fork server imports once, so that a worker does not (several seconds of CPU each on a small machine):
what every job needs, and what a job's first call would import lazily (pytest included: a worker imports the test
module that defines a job to unpickle it). First, ``tests.forkserver_guard``, which ties the server's life to its
parent's."""


class RankError(RuntimeError):
    """A job raised on one or more ranks; carries the first failing rank's exception type and message."""

    def __init__(self, message: str, exc_type: str, exc_message: str, all_ranks_failed: bool) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.all_ranks_failed = all_ranks_failed


@dataclass
class _Outcome:
    rank: int
    ok: bool
    value: Any = None
    exc_type: str = ""
    exc_message: str = ""
    trace: str = ""
    threads: int = 0
    """The worker's OS threads after the job."""


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0


def _die_with_parent() -> None:
    """On Linux, this worker gets SIGKILL when its parent (the fork server, which ends with the pytest process) ends:
    a pytest that crashed leaves no idle workers behind."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _worker(rank: int, world_size: int, port: int, log_dir: str, inbox: Any, outbox: Any) -> None:
    _die_with_parent()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    # The cores shared by the ranks, as torchrun and Lightning's launchers share them. OMP_NUM_THREADS too, so that
    # libraries that size their own thread pool from the environment (Accelerate's PartialState does) leave it alone.
    threads = torch.get_num_threads()
    if os.environ.get("PAR3D_TEST_THREADS", "1") == "1":
        threads = max(1, (os.cpu_count() or 1) // world_size)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    log = open(Path(log_dir) / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 (lives as long as the worker)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # a hung job's stacks, for the report
    while (job := inbox.get()) is not None:
        fn, kwargs = job
        print(f"=== job {fn.__module__}.{fn.__name__}", flush=True)
        environment = dict(os.environ)  # jobs may change it (Lightning's teardown drops WORLD_SIZE): give it back
        sys.stdout = sys.stderr = log  # a failed job may have muted them (par3d quiets a rank that failed second)
        torch.set_num_threads(threads)
        # On GPUs, matmuls in full fp32 on every rank, as in the single-process references: TF32 would round them
        # differently on each side of a parity comparison.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        try:
            outcome = _Outcome(rank, True, fn(**kwargs))
        except BaseException as e:  # report everything, keep serving
            outcome = _Outcome(rank, False, None, type(e).__name__, str(e), traceback.format_exc())
        os.environ.clear()
        os.environ.update(environment)
        outcome.threads = _os_threads()
        print(f"=== threads after the job: {outcome.threads}", flush=True)
        outbox.put(outcome)


def _context() -> Any:
    """``forkserver`` where the platform has it (the server imports :data:`PRELOAD` and runs nothing else, so
    forking it is safe: no threads, no process group), else ``spawn``; ``PAR3D_TEST_START`` picks."""
    if os.environ.get("PAR3D_TEST_START", "forkserver") == "forkserver" and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


class DistPool:
    """``world_size`` gloo ranks that run jobs: plain module-level functions called with keyword arguments."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"par3d-pool{world_size}-"))
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._log_starts: dict[int, int] = {}

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        args = [
            (rank, self.world_size, port, str(self.log_dir), self._inboxes[rank], self._outbox)
            for rank in range(self.world_size)
        ]
        self._procs = [ctx.Process(target=_worker, args=a, daemon=True) for a in args]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Runs ``fn(**kwargs)`` on every rank; returns the results by rank or raises :class:`RankError` (or
        ``TimeoutError`` past ``timeout`` seconds)."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._log_starts = {r: self._log_size(r) for r in range(self.world_size)}
        for inbox in self._inboxes:
            inbox.put((fn, kwargs))
        outcomes = self._collect(timeout)
        failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.rank)
        missing = sorted(set(range(self.world_size)) - {o.rank for o in outcomes})
        hung = self._hung(missing) if missing else ""  # before close(): the stacks of a rank still hanging
        if missing or 0 < len(failed) < self.world_size:
            self.close()  # a partial failure or a hang leaves collectives mismatched: start afresh next time
        elif max(o.threads for o in outcomes) > RECYCLE_THREADS:
            self.close()
        if missing:
            detail = f"{hung}\nrank {failed[0].rank} failed meanwhile:\n{failed[0].trace}" if failed else hung
            raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} within {timeout:.0f} s.\n{detail}")
        if failed:
            first = failed[0]
            raise RankError(
                f"{fn.__name__} failed on ranks {[o.rank for o in failed]}; rank {first.rank} "
                f"(log: {self.log_dir / f'rank{first.rank}.log'}):\n{first.trace}",
                first.exc_type,
                first.exc_message,
                all_ranks_failed=len(failed) == self.world_size,
            )
        return [o.value for o in sorted(outcomes, key=lambda o: o.rank)]

    def _collect(self, timeout: float) -> list[_Outcome]:
        deadline = time.monotonic() + timeout
        outcomes: list[_Outcome] = []
        while len(outcomes) < self.world_size and (remaining := deadline - time.monotonic()) > 0:
            try:
                outcomes.append(self._outbox.get(timeout=min(remaining, 1.0)))
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    break  # a rank died (killed, segfault): do not wait for the deadline
        return outcomes

    def _hung(self, missing: list[int]) -> str:
        """The first missing rank's log tail, ending with every thread's stack where it hangs (SIGUSR1 makes the
        worker's ``faulthandler`` write them); called before :meth:`close`."""
        rank = missing[0]
        process = self._procs[rank] if rank < len(self._procs) else None
        if process is not None and process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGUSR1)
                time.sleep(2.0)
        return self.log_tail(rank, chars=8000)

    def log_tail(self, rank: int, chars: int = 4000) -> str:
        """The last ``chars`` of what ``rank`` logged during the last :meth:`run` (a long-lived worker's log holds
        the jobs of earlier tests too, which a test must not read as its own)."""
        path = self.log_dir / f"rank{rank}.log"
        if not path.exists():
            return f"{path}: no log"
        with path.open("rb") as log:
            log.seek(self._log_starts.get(rank, 0))
            text = log.read().decode(errors="replace")
        return f"{path}:\n{text[-chars:]}"

    def _log_size(self, rank: int) -> int:
        path = self.log_dir / f"rank{rank}.log"
        return path.stat().st_size if path.exists() else 0

    def close(self) -> None:
        for inbox in self._inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        for p in self._procs:
            if p.pid is None:
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._inboxes = [], []
