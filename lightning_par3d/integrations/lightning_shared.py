"""What the Lightning Trainer and Fabric strategies share: :class:`LightningFrontEnd` (the engine, the layout from
Lightning's devices and nodes, the launcher, the default process group through Lightning's cluster environment and
the mesh, the collectives Lightning asks a strategy for, the transformers export), and the job's end after a
failure."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_par3d.config import Layout, Par3DConfig, config_from
from lightning_par3d.distributed import faults, groups
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.distributed.threads import set_threads_per_rank
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.elastic import check_front_end
from lightning_par3d.integrations.framework_private import (
    DeviceDtypeModuleMixin,
    default_backend_for,
    distributed_is_initialized,
    init_dist_connection,
)
from lightning_par3d.planning.at_launch import batch_shape
from lightning_par3d.planning.measuring import MeasureWith
from lightning_par3d.utils.console import known_upstream_warnings_once_per_job

T = TypeVar("T")


def engine_for(owner: str, config: Par3DConfig | None, settings: Mapping[str, Any]) -> Par3DEngine:
    """The engine of a strategy created with a ``Par3DConfig`` or with its fields as keywords (``settings``), not
    both (see :func:`~lightning_par3d.config.config_from`)."""
    resolved = config_from(owner, config, settings)
    check_front_end(owner, resolved)
    return Par3DEngine(resolved)


def init_distributed(
    cluster_environment: ClusterEnvironment, device: torch.device, backend: str | None, timeout_s: float
) -> str:
    """Initializes the default process group through Lightning (its cluster environment sets the address, port and
    ranks) if nobody has, giving the ranks at least :data:`~lightning_par3d.distributed.groups.JOIN_TIMEOUT_FLOOR_S` to
    join; returns the backend. :meth:`Par3DEngine.setup <lightning_par3d.engine.Par3DEngine.setup>` then sets the
    collective timeout, as it does for a group anyone else created."""
    backend = backend or default_backend_for(device)
    store = groups.restart_store(timeout_s)  # under torchrun: this launch's keys only
    init_dist_connection(
        cluster_environment,
        backend,
        timeout=groups.join_timeout(timeout_s),
        device_id=device if device.type != "cpu" else None,
        **({"store": store} if store is not None else {}),
    )
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
        if isinstance(sub, DeviceDtypeModuleMixin):
            sub._device = device


_REPORT_WAIT_S = 5.0
"""How long the launcher waits for the rank that failed first to print its message before ending the job."""


def end_job(launcher: Any, message: str, quiet: bool = False) -> None:
    """After a rank failed: says so, and kills the other local ranks that this process launched (Lightning's
    subprocess launcher), which might otherwise wait in a collective forever. Under torchrun or SLURM the failed
    process exits non-zero and their agent ends the others.

    ``quiet`` (another rank failed first, and said why): prints nothing, and sends what this process would still
    print (Lightning's and Hydra's tracebacks of a consequence of that failure) nowhere, so that a job's console
    holds its cause once; before it kills the ranks it launched, it waits (a few seconds at most) for the rank that
    failed first to have printed that cause."""
    procs = getattr(launcher, "procs", None) or []
    if quiet:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (for the rest of this failing process)
        if any(proc.poll() is None for proc in procs):
            faults.await_report(_REPORT_WAIT_S)
    else:
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        faults.note_reported()
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    skip_the_shutdown_collection()


def end_failed_job(launcher: Any, engine: Par3DEngine, error: BaseException) -> None:
    """:func:`end_job` for ``error`` on this rank: the engine's description, printed if this rank failed first."""
    message = engine.describe_failure(error)
    end_job(launcher, message, quiet=not engine.failed_first())


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


def check_checkpoint_directories(engine: Par3DEngine, trainer: Any) -> None:
    """Before fitting, that every node sees each ``ModelCheckpoint``'s directory (on many nodes): found before
    training, not at the next load."""
    for callback in trainer.checkpoint_callbacks:
        directory = getattr(callback, "dirpath", None)
        if directory and trainer.state.fn == "fit":
            engine.saves.checkpoint_directories.check(directory)


def is_failure(exception: BaseException) -> bool:
    """A raised exception that ends a rank's run (not a clean ``sys.exit(0)``)."""
    return not (isinstance(exception, SystemExit) and exception.code in (0, None))


def end_job_on_uncaught_exception(launcher: Any, engine: Par3DEngine) -> None:
    """For front-ends without an exception hook (Fabric): an exception that ends the script ends the job too."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if is_failure(error) and not isinstance(error, KeyboardInterrupt):
            end_failed_job(launcher, engine, error)
        previous(kind, error, trace)

    sys.excepthook = hook


def broadcast(obj: T, src: int = 0) -> T:
    """``obj`` from rank ``src`` on every rank (pickled)."""
    if not distributed_is_initialized():
        return obj
    box: list[Any] = [obj]
    torch.distributed.broadcast_object_list(box, src)
    return box[0]


class LightningStrategy(Protocol):
    """What :class:`LightningFrontEnd` uses of the strategy it is mixed into: Lightning's ``ParallelStrategy`` (the
    Trainer's or Fabric's, whose annotations differ) and the par3d strategy's own attributes. A structural type, so
    that mypy checks every use in the shared methods against both strategies."""

    engine: Par3DEngine
    launcher_class: Any
    _launcher: Any
    _process_group_backend: str | None

    @property
    def parallel_devices(self) -> list[torch.device] | None: ...

    @property
    def cluster_environment(self) -> ClusterEnvironment | None: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...

    def resolve_world(self) -> None: ...

    def _note_precision(self) -> None: ...

    def broadcast(self, obj: T, src: int = 0) -> T: ...


class LightningFrontEnd:
    """Mixed into the Trainer's and Fabric's strategies, before Lightning's ``ParallelStrategy``: the parts of a
    Lightning strategy that are the same for both, each a translation to :class:`~lightning_par3d.engine.Par3DEngine`.
    The strategy sets ``engine`` and ``_process_group_backend``, and :attr:`launcher_class` (the Trainer's or
    Fabric's subprocess launcher). Each method's ``self`` is a :class:`LightningStrategy`: what it uses of either
    strategy is typed and checked."""

    launcher_class: Any = None
    engine: Par3DEngine
    _process_group_backend: str | None

    @property
    def config(self: LightningStrategy) -> Par3DConfig:
        return self.engine.config

    @property
    def loads_pretrained(self: LightningStrategy) -> bool:
        """Whether par3d reads the model's weights from a ``save_pretrained`` directory (``init="pretrained"``):
        ``configure_model`` then builds the transformers model from its config (``from_config``), not with
        ``from_pretrained``."""
        return self.engine.config.init == "pretrained"

    @property
    def layout(self: LightningStrategy) -> Layout:
        """The resolved layout, known once Lightning has set devices and nodes (under ``layout="auto"``, once it is
        chosen at launch: after ``setup``)."""
        self.resolve_world()
        return self.engine.layout

    def resolve_world(self: LightningStrategy) -> None:
        """Runs every check that needs the world size, once Lightning has set devices and nodes, before any process
        is launched; fixes the layout unless ``layout="auto"`` chooses it at launch."""
        if not self.engine.placement.is_resolved:
            self._note_precision()
            device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
            self.engine.resolve(self.num_nodes * self.num_processes, device_type)

    def plan_layout(
        self: LightningStrategy,
        module: torch.nn.Module,
        loader: Any,
        where: str,
        accumulate: int | None = None,
        sample: MeasureWith | None = None,
    ) -> None:
        """``layout="auto"``: every rank plans the layout now (:meth:`Par3DEngine.choose_layout
        <lightning_par3d.engine.Par3DEngine.choose_layout>`), with ``module`` (a meta copy, before
        ``configure_model``) and the shape of a batch of ``loader`` (or ``plan_batch``; ``where`` names the loader
        in the error if neither tells it); ``accumulate``: the Trainer's ``accumulate_grad_batches``, which the
        chosen layout may change (None: Fabric's loop accumulates as the user writes it); ``sample``: what to
        measure the fastest predicted layouts with (None: no measuring)."""
        rank_batch, seq_len = batch_shape(self.engine.config, loader, where)
        self.engine.choose_layout(
            module if self.global_rank == 0 else None, rank_batch, seq_len, accumulate=accumulate, sample=sample
        )

    def _note_precision(self) -> None:
        """Tells the engine the precision before the layout is resolved (Fabric; the Trainer does it when Lightning
        sets its precision plugin)."""

    @property
    def mesh(self: LightningStrategy) -> Par3DMesh:
        return self.engine.mesh

    @property
    def root_device(self: LightningStrategy) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self: LightningStrategy) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self: LightningStrategy) -> dict[str, Any]:
        """Data is split over data-parallel ranks only: tensor-parallel and pipeline peers read the same batches."""
        return self.engine.sampler_kwargs()

    def _configure_launcher(self: LightningStrategy) -> None:
        """Lightning's subprocess launcher, on every rank, as Lightning's ``DDPStrategy`` has it: it starts the
        other local ranks only where the cluster environment does not (never in them, nor under torchrun or
        SLURM). CPU ranks get par3d's threads (:mod:`lightning_par3d.distributed.threads`) unless the user set
        ``OMP_NUM_THREADS``, exported before the launcher starts the other ranks, which inherit it (Lightning's
        launcher then leaves the count alone; GPU ranks keep Lightning's rule). The layout is validated first,
        before any process is launched."""
        self.resolve_world()
        if self.root_device.type == "cpu":
            set_threads_per_rank(self.num_processes)
        assert self.cluster_environment is not None
        self._launcher = self.launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def start_distributed(self: LightningStrategy) -> None:
        """This rank's place in the world, the default group (through Lightning's cluster environment, if nobody
        made it) and the mesh."""
        assert self.cluster_environment is not None
        reset_seed()
        set_world_ranks(self.cluster_environment, self.node_rank, self.local_rank, self.num_processes, self.num_nodes)
        config = self.engine.config
        backend = init_distributed(
            self.cluster_environment, self.root_device, self._process_group_backend, config.timeout_s
        )
        self._process_group_backend = backend
        self.engine.setup(self.root_device, backend, devices_per_node=self.num_processes)
        known_upstream_warnings_once_per_job(self.engine.rank)

    def barrier(self: LightningStrategy, *args: Any, **kwargs: Any) -> None:
        self.engine.barrier()

    def broadcast(self, obj: T, src: int = 0) -> T:
        return broadcast(obj, src)

    def save_pretrained(self: LightningStrategy, directory: str | Path) -> Path:
        """Writes the Hugging Face transformers model inside the module as a ``save_pretrained`` directory (see
        :meth:`Par3DEngine.save_pretrained <lightning_par3d.engine.Par3DEngine.save_pretrained>`); every rank must
        call it, as in ``on_train_end``. :class:`~lightning_par3d.callbacks.SavePretrained` does it for you."""
        return self.engine.save_pretrained(self.broadcast(str(directory)))
