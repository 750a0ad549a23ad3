"""When a rank fails: which rank failed first, why, and where every rank was.

Every rank notes the step it is starting in the default group's key-value store (one small write per step). When
a rank raises (a collective that timed out included), :func:`describe_failure` records the failure there (the first
rank to record one wins), and writes for a person which rank failed first and why, and, for a timeout, how far
each rank had come, which names the rank that stalled. The store calls on this path use a short timeout: the
store's host (rank 0) may be the rank that died.

A job prints its cause once: :func:`failed_first` tells the front-ends whether this rank's failure is the one the
store recorded first, and only that rank prints; the others end quietly (their failures are consequences, or the
same error again), unless the store cannot say (rank 0, its host, died), when each prints.

The store outlives a run: a notebook, a Hydra multirun or a ``fit`` after a ``fit`` keeps the process group, and a
failure recorded by an earlier run would be read as this run's first (naming the wrong rank and cause, and keeping
the rank that really failed first quiet). So the keys are the run's own: :func:`new_run`, which every rank calls at
the same points (the engine's setup), numbers them, with no collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_par3d.utils.torch_private import default_store

FIRST_FAILURE = "first_failure"
REPORTED = "first_failure_reported"
"""Set once the rank that failed first has printed its message (:func:`note_reported`)."""
_RUN = [0]
"""This process's runs so far (:func:`new_run`): the number in the keys of the current one."""
_SIGNS_OF_A_LOST_PEER = ("timed out", "timeout", "closed by peer", "reset by peer", "broken pipe", "connection refused")
"""Words (lower case) of the errors a collective raises when another rank stalled or died."""
_STORE_TIMEOUT_S = 5.0
"""How long a store call on the failure path waits."""
_MORE_LINES = 40
"""At most this many further lines of an error's message are repeated in the failure message."""


def _store() -> Any:
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return default_store()
    except (RuntimeError, ValueError):
        return None


def new_run() -> None:
    """A run begins in this process (a ``fit``, a ``validate``, a Fabric script's setup): its failure record and its
    step notes start empty. Every rank of the job calls it at the same points, so they agree on the run's keys."""
    _RUN[0] += 1


@contextlib.contextmanager
def _answering_soon(store: Any) -> Iterator[None]:
    """The store's calls within wait :data:`_STORE_TIMEOUT_S` at most (its host, rank 0, may be the rank that died);
    its own timeout is given back after, since the store serves the run's later calls and the process's later runs
    (creating groups, say) too."""
    if store is None:
        yield
        return
    previous = store.timeout
    store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
    try:
        yield
    finally:
        store.set_timeout(previous)


def _key(name: str) -> str:
    return f"par3d/run{_RUN[0]}/{name}"


def run_key(name: str) -> str:
    """A key of the job's store that is this run's own (see the module docstring), for ``name``."""
    return _key(name)


def note_step(rank: int, step: int) -> None:
    """Records that ``rank`` is starting ``step`` (read only when something fails)."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_key(f"step/{rank}"), str(step))


def describe_failure(rank: int, world_size: int, error: BaseException, timeout_s: float) -> str:
    """Records ``rank``'s failure and returns a message naming the rank that failed first, why, and (for a
    collective that timed out or lost a peer) the step each rank had started."""
    store = _store()
    with _answering_soon(store):
        return _describe(rank, world_size, error, timeout_s, store)


def _describe(rank: int, world_size: int, error: BaseException, timeout_s: float, store: Any) -> str:
    detail = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {detail[0] if detail else ''}"
    lines = [f"par3d: rank {rank} failed: {text[:500]}"]
    # The rest of the error (a list of problems, say) too: Lightning's launcher may kill this process (SIGKILL, once
    # it sees a rank it launched end) before the traceback is printed, and then this message is all a person sees.
    rest = [f"    {line[:500]}" for line in detail[1:] if line.strip()]
    lines += rest[:_MORE_LINES] + ([f"    … ({len(rest) - _MORE_LINES} more lines)"] if len(rest) > _MORE_LINES else [])
    cause = error.__cause__  # (torch's pipeline stages wrap what failed in a stage: that is the news)
    if cause is not None:
        said = str(cause).strip().splitlines()
        lines.append(f"  caused by {type(cause).__name__}: {said[0][:500] if said else ''}")
    first = None
    if store is not None:
        try:
            first = store.compare_set(_key(FIRST_FAILURE), "", f"{rank}|{text[:500]}").decode()
        except Exception:
            store = None
            lines.append("  The key-value store hosted by rank 0 does not answer: rank 0 has probably died.")
    if first and not first.startswith(f"{rank}|"):
        other, _, why = first.partition("|")
        lines.append(f"  rank {other} failed first: {why}")
    if any(word in text.lower() for word in _SIGNS_OF_A_LOST_PEER):
        lines.append(
            f"  A collective timed out (timeout_s={timeout_s:g}) or lost a peer: another rank stopped responding "
            "(stalled, deadlocked, or died)."
        )
        steps = _steps(store, world_size)
        if steps:
            behind = min(steps.values())
            laggards = [r for r, s in steps.items() if s == behind]
            listing = ", ".join(f"rank {r}: {s}" for r, s in sorted(steps.items()))
            if len(laggards) < len(steps):
                lines.append(f"  Step each rank started: {listing}. Behind: rank(s) {laggards}.")
            else:
                lines.append(f"  Every rank started step {behind}.")
    lines.append("  Ending the whole job (every local rank), so that no process is left waiting.")
    return "\n".join(lines)


def failed_first(rank: int) -> bool:
    """Whether ``rank``'s failure is the first one recorded in the job (True too when no store can tell: then every
    failing rank speaks for itself)."""
    store = _store()
    if store is None:
        return True
    with _answering_soon(store):
        try:
            if not store.check([_key(FIRST_FAILURE)]):
                return True
            return bool(store.get(_key(FIRST_FAILURE)).decode().startswith(f"{rank}|"))
        except Exception:
            return True


def note_reported() -> None:
    """Tells the job that the rank which failed first has printed its message."""
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_key(REPORTED), "1")


def await_report(seconds: float) -> None:
    """Waits, at most ``seconds``, until the rank that failed first has printed its message (:func:`note_reported`).

    The process that ends the job by killing the ranks it launched (Lightning's launcher, rank 0) calls this first
    when another rank failed first: that rank records its failure, then reads every rank's step, then prints, and
    killed in between it would print nothing, leaving a console that never says what went wrong."""
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.wait([_key(REPORTED)], timedelta(seconds=seconds))


def _steps(store: Any, world_size: int) -> dict[int, int]:
    if store is None:
        return {}
    steps = {}
    for rank in range(world_size):
        with contextlib.suppress(Exception):
            key = _key(f"step/{rank}")
            if store.check([key]):
                steps[rank] = int(store.get(key).decode())
    return steps
