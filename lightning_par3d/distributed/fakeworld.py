"""The planner's simulated processes: torch's fake process group, entered and left without traces.

The planner builds schedules and tensor-parallel parts of the model in one process, playing rank 0 of a world of
fake processes (torch's ``"fake"`` backend: its collectives move nothing), as the memory estimator does. Each
``init_process_group`` also wraps ``sys.excepthook`` to prefix tracebacks with ``[rank0]:``, and never unwraps it,
so a planner that enters hundreds of fake worlds would print every later traceback with hundreds of prefixes:
:func:`keep_excepthook` puts the hook back.

DTensor caches its sharding decisions by mesh *equality*, and a cached decision holds the mesh it was made on. A
mesh of a later fake world that equals one of an earlier world (the same ranks and names) is then handed the earlier
mesh, whose process groups are gone: its next collective fails with "Could not resolve the process group". Leaving a
fake world (:func:`forget_meshes`) clears that cache.

Planning makes millions of short-lived Python objects (fake tensors and their metadata), each of which would count
toward the cyclic garbage collector's next pass over the whole young heap: :func:`collector_paused` pauses it while
the planner, the estimator and the dry run work, and collects once at the end. (Until 2026-11-29 the cycles were
kept, never cleared, after an 8B plan crashed inside the collector; the cause was elsewhere and is fixed:
:func:`~lightning_par3d.utils.torch_private.deepcopy_with_fake_tensors`.)
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lightning_par3d.utils.torch_private import clear_sharding_propagation_cache


def check_no_process_group(what: str) -> None:
    """Raises where a default process group exists: the planner simulates every rank in this one process."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            f"{what} simulates every rank in this process with torch's fake process group, so it runs before launch "
            "(no process group yet). Call it from the launching script or from `python -m lightning_par3d.plan`."
        )


@contextmanager
def keep_excepthook() -> Iterator[None]:
    """Restores ``sys.excepthook`` on the way out (``init_process_group`` wraps it on every call)."""
    hook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = hook


@contextmanager
def forget_meshes() -> Iterator[None]:
    """Clears DTensor's sharding-propagation cache on the way out, so that no later mesh is handed this world's
    meshes (see the module docstring)."""
    try:
        yield
    finally:
        clear_sharding_propagation_cache()


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A default process group of torch's fake backend, in which this process plays rank 0 of ``world_size``."""
    check_no_process_group("The planner")
    with keep_excepthook(), forget_meshes():
        dist.init_process_group("fake", rank=0, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()


_DEPTH = threading.local()


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused within (the planner, the estimator, the dry run: sections nest), and one
    collection of the youngest generation at the end of the outermost, which clears the cycles the section left.
    With the collector paused every object the section made is still in that generation, and a full collection
    would walk the whole heap (0.28 s per estimate in a process that has imported Lightning, most of an estimate of
    a small model); an 8B Llama's plan at 64 ranks took 71 s with the collector running, 64 s paused. Reference
    counting frees everything else as usual, within the section too."""
    depth = getattr(_DEPTH, "value", 0)
    _DEPTH.value = depth + 1
    enabled = gc.isenabled()
    if depth == 0:
        gc.disable()
    try:
        yield
    finally:
        _DEPTH.value = depth
        if depth == 0:
            try:
                gc.collect(0)
            finally:
                if enabled:
                    gc.enable()
