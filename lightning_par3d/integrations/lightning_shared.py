"""What the Lightning Trainer and Fabric strategies share: the default process group through Lightning's cluster
environment, the world ranks, and the collectives Lightning asks a strategy for."""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_par3d.config import Par3DConfig
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.parallel import groups

T = TypeVar("T")


def engine_for(owner: str, config: Par3DConfig | None, settings: dict[str, Any]) -> Par3DEngine:
    """The engine of a strategy created with a ``Par3DConfig`` or with its fields as keywords (not both)."""
    if config is not None and settings:
        raise TypeError(
            f"Pass either a Par3DConfig or its fields to {owner}, not both (got config and "
            f"{', '.join(sorted(settings))})."
        )
    return Par3DEngine(config if config is not None else Par3DConfig(**settings))


def init_distributed(
    cluster_environment: ClusterEnvironment, device: torch.device, backend: str | None, timeout_s: float
) -> str:
    """Initializes the default process group (if nobody has), giving the ranks at least
    :data:`~lightning_par3d.parallel.groups.JOIN_TIMEOUT_FLOOR_S` to join, and sets its collective timeout;
    returns the backend."""
    backend = backend or _get_default_process_group_backend_for_device(device)
    _init_dist_connection(
        cluster_environment,
        backend,
        timeout=groups.join_timeout(timeout_s),
        device_id=device if device.type != "cpu" else None,
    )
    groups.set_collective_timeout(timeout_s)
    return backend


def set_world_ranks(
    cluster_environment: ClusterEnvironment | None, node_rank: int, local_rank: int, procs: int, nodes: int
) -> int:
    """Tells the cluster environment and Lightning's rank-zero utilities this process's global rank; returns it."""
    rank = node_rank * procs + local_rank
    if cluster_environment is not None:
        cluster_environment.set_global_rank(rank)
        cluster_environment.set_world_size(nodes * procs)
        rank = cluster_environment.global_rank()
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]
    return rank


def point_at_device(module: torch.nn.Module, device: torch.device) -> None:
    """Tells Lightning's modules (their ``.device``) where the materialized model lives: par3d moved the model to
    meta and materialized it with ``to_empty``, which Lightning's device bookkeeping does not see."""
    for sub in module.modules():
        if isinstance(sub, _DeviceDtypeModuleMixin):
            sub._device = device


def end_job(launcher: Any, message: str) -> None:
    """After a rank failed: says so, and kills the other local ranks that this process launched (Lightning's
    subprocess launcher), which might otherwise wait in a collective forever. Under torchrun or SLURM the failed
    process exits non-zero and their agent ends the others."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    for proc in getattr(launcher, "procs", None) or []:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    skip_the_shutdown_collection()


def skip_the_shutdown_collection() -> None:
    """When this process exits, its interpreter skips the garbage collection of the whole heap it runs at shutdown.

    That collection walks every object torch, Lightning and the model created (millions in a large job), which takes
    seconds of CPU, and tens of seconds on a busy node (measured: most of a failed rank's exit on a loaded 2-core
    machine); the job is not over, for the launcher or the agent, until it is done. ``gc.freeze()`` moves the heap out
    of the collector's reach. It is registered as an exit handler at the failure, so it runs before the handlers
    registered earlier (``atexit`` runs them last in, first out); those still run (loggers' included), objects are
    still freed as their references go, and the operating system reclaims the rest. Registered at a failure only,
    and run at exit only, so a process that catches the error and goes on is collected as before while it runs."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def is_failure(exception: BaseException) -> bool:
    """A raised exception that ends a rank's run (not a clean ``sys.exit(0)``)."""
    return not (isinstance(exception, SystemExit) and exception.code in (0, None))


def end_job_on_uncaught_exception(launcher: Any, describe: Callable[[BaseException], str]) -> None:
    """For front-ends without an exception hook (Fabric): an exception that ends the script ends the job too."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if is_failure(error) and not isinstance(error, KeyboardInterrupt):
            end_job(launcher, describe(error))
        previous(kind, error, trace)

    sys.excepthook = hook


def barrier(device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast(obj: T, src: int = 0) -> T:
    """``obj`` from rank ``src`` on every rank (pickled)."""
    if not _distributed_is_initialized():
        return obj
    box: list[Any] = [obj]
    torch.distributed.broadcast_object_list(box, src)
    return box[0]
