"""Where this rank is: the configuration checked against the world before any process group, the default group and
the mesh, (``layout="auto"``) the layout chosen at launch, this rank's coordinates in the mesh, the reductions
over its data-parallel peers (:mod:`~lightning_par3d.engine.collectives`), the same for every front-end, and this
rank's failure (:mod:`~lightning_par3d.distributed.faults`).

:class:`Placement` is a part of :class:`~lightning_par3d.engine.Par3DEngine` (``engine.placement``), whose names
the engine reads as its own (:class:`~lightning_par3d.utils.parts.PartOf`): ``engine.layout``, ``engine.mesh``,
``engine.dp_rank``, ``engine.reduce(...)`` are the placement's. The engine adds the model's life; the token mean
(:mod:`~lightning_par3d.engine.tokens`) and the checkpoints (:class:`~lightning_par3d.engine.saving.ModelSaves`)
are parts of their own that read the placement."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.distributed import faults, groups
from lightning_par3d.distributed.locality import launcher_devices_per_node, tp_across_nodes
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.distributed.metric_sync import SyncFn, attach_metric_sync, quiet_compute_before_update
from lightning_par3d.engine import collectives, trial
from lightning_par3d.engine.elastic import relayout
from lightning_par3d.parallel.compile import check_compile
from lightning_par3d.parallel.compression import check_compression_device
from lightning_par3d.parallel.precision import PRECISIONS, check_precision
from lightning_par3d.planning.at_launch import BatchSplit, check_before_launch
from lightning_par3d.planning.calibrate import calibrate_job
from lightning_par3d.planning.measuring import MeasureWith, choose


class Placement:
    """The configuration, the world it was resolved for, and this rank's place: validation before any process group
    (:meth:`resolve`), the default group and the mesh (:meth:`setup`), the layout chosen at launch
    (:meth:`choose_layout`), and the mesh coordinates the rest of the engine reads."""

    def __init__(self, config: Par3DConfig, precision: str = "32-true") -> None:
        resolve_layout(config)  # the checks that need no world size, now
        if precision not in PRECISIONS:
            check_precision(precision, zero_stage=0)
        self.config = config
        self.failed = False
        """Set when this rank failed (:meth:`describe_failure`): the end then waits for nothing of the other ranks."""
        self.precision = precision
        self._layout: Layout | None = None
        self._world: tuple[int, str] | None = None
        """The world size and device type :meth:`resolve` was given."""
        self._mesh: Par3DMesh | None = None
        self._device: torch.device | None = None
        self._devices_per_node: int | None = None
        self.relayout_note: str | None = None
        """Under ``elastic=True``, what :meth:`resolve` changed in the sizes to fit the world (None: nothing)."""
        self._backend = "gloo"
        self.batch_split: BatchSplit | None = None
        """Under ``layout="auto"``, once chosen: how the layout takes the global batch (per-rank batch size and
        accumulated batches), which the front-end applies to the training data."""

    def resolve(self, world_size: int, device_type: str = "cpu") -> Layout | None:
        """Validates the configuration against the world size, the precision and the device type, and fixes the
        layout (None under ``layout="auto"``, whose layout :meth:`choose_layout` fixes at launch). Raises
        ``ValueError`` listing every problem; call it before any process is launched."""
        self._world = (world_size, device_type)
        check_compression_device(self.config.grad_compression, device_type)
        if self.config.compile:
            check_compile(self.config.compile_options, device_type)
        if self.config.elastic:  # the sizes that still fit this world (lightning_par3d.engine.elastic)
            self.config, self.relayout_note = relayout(self.config, world_size)
        if self.awaits_layout:
            resolve_layout(self.config)  # the checks that need no world size
            check_before_launch(self.config, world_size)
            return None
        layout = resolve_layout(self.config, world_size)
        assert layout is not None
        check_precision(self.precision, layout.zero)
        self._layout = layout
        return layout

    @property
    def is_resolved(self) -> bool:
        """Whether :meth:`resolve` has checked the configuration against the world (front-ends resolve lazily, once
        devices are known)."""
        return self._world is not None

    @property
    def awaits_layout(self) -> bool:
        """Whether the layout is still to be chosen at launch (``layout="auto"``, before :meth:`choose_layout`)."""
        return self.config.layout == "auto" and self._layout is None

    @property
    def is_set_up(self) -> bool:
        """Whether :meth:`setup` has run on this rank (the mesh exists)."""
        return self._mesh is not None

    @property
    def layout(self) -> Layout:
        if self._layout is None and self.config.layout == "auto":
            raise RuntimeError(
                "layout='auto': the layout is chosen at launch, when the model is set up (the Trainer's setup; "
                "Fabric's setup_module, which must come before setup_dataloaders; Accelerate's prepare of the model "
                "with its dataloader; Par3DEngine.choose_layout); it is known after that."
            )
        if self._layout is None:
            raise RuntimeError("The par3d layout is known once the world size is: call Par3DEngine.resolve() first.")
        return self._layout

    def setup(self, device: torch.device, backend: str | None = None, devices_per_node: int | None = None) -> None:
        """Initializes the default process group from the environment if nobody has (torchrun's variables), then
        takes the mesh for the layout (built, or shared with an earlier engine of the same layout); under
        ``layout="auto"`` the mesh waits for :meth:`choose_layout`. Every rank must call it. ``devices_per_node``
        (the launcher's processes per node: Lightning's ``devices``) defaults to torchrun's ``LOCAL_WORLD_SIZE``,
        then SLURM's ``SLURM_NTASKS_PER_NODE``, then the whole world (one node); rank 0 warns when tensor-parallel
        groups cross nodes (:mod:`lightning_par3d.distributed.locality`)."""
        self._device = device
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self._devices_per_node = devices_per_node or launcher_devices_per_node(world)
        if not self.is_resolved:
            self.resolve(world, device.type)
        self._backend = groups.init_default_group(device, self.config.timeout_s, backend)
        groups.destroy_groups_at_exit()
        groups.set_collective_timeout(self.config.timeout_s)  # also when a front-end created the group
        faults.new_run()  # a failure of an earlier run in this process is not this run's
        if not self.awaits_layout:
            self._take_mesh()

    def calibrate(self) -> Any:
        """This job's machine figures (:class:`~lightning_par3d.planning.machine.Machine`), measured by every rank at
        once over the job's own process group (every rank must call it): what the planner predicts with at launch
        (``layout="auto"``) and the bottleneck report's advice at the end of fit."""
        return calibrate_job(self.device, lambda ranks: groups.group_of(ranks, self._backend, self.config.timeout_s))

    def _take_mesh(self) -> None:
        if dist.get_world_size() != self.layout.world_size:
            raise ValueError(
                f"The par3d layout ({self.layout}) needs {self.layout.world_size} processes, but the process group "
                f"has {dist.get_world_size()}. Launch {self.layout.world_size} processes, or change the sizes."
            )
        self._mesh = groups.acquire_mesh(self.layout, self.device, self._backend, self.config.timeout_s)
        across = tp_across_nodes(self.layout, self.devices_per_node)
        if across is not None and dist.get_rank() == 0:
            warnings.warn(f"par3d: {across}", stacklevel=3)

    def choose_layout(
        self,
        module: nn.Module | None,
        rank_batch: int,
        seq_len: int,
        devices_per_node: int | None = None,
        accumulate: int | None = None,
        sample: MeasureWith | None = None,
    ) -> Layout:
        """``layout="auto"``: plans the layout at launch (every rank, after :meth:`setup`, before the model is
        parallelized; see :mod:`lightning_par3d.planning.at_launch`), makes the chosen configuration this engine's,
        and builds its mesh. ``module`` is the model before ``configure_model`` (a LightningModule, or a factory of
        an ``nn.Module``), needed on rank 0 only; ``rank_batch`` and ``seq_len`` are a training batch's samples per
        data-parallel rank and tokens per sample; ``devices_per_node`` defaults to the launcher's
        devices per node :meth:`setup` found. ``accumulate``: the Trainer's ``accumulate_grad_batches``, which the
        chosen layout may change to keep the global batch (None where the user's loop accumulates).
        :attr:`batch_split` then says how the layout takes the global batch. ``sample``: the model and a batch to
        measure the fastest predicted layouts with, on every rank (``measure``; :mod:`lightning_par3d.planning.
        measuring`); None: train the fastest predicted."""
        if not self.awaits_layout:
            raise RuntimeError("Par3DEngine.choose_layout() is for layout='auto', once, after setup().")
        world = dist.get_world_size()
        local = devices_per_node or self.devices_per_node
        chosen = choose(
            self.config, module, sample, world_size=world, devices_per_node=local, rank_batch=rank_batch,
            seq_len=seq_len, precision=self.precision, device=self.device, calibrate=self.calibrate,
            accumulate=accumulate, step_time=trial.measure_step,
        )  # fmt: skip
        self.config, self.batch_split = chosen.config, chosen.split
        self._world = None
        layout = self.resolve(world, self.device.type)
        assert layout is not None
        self._take_mesh()
        return layout

    @property
    def devices_per_node(self) -> int:
        """Processes per node, as the launcher started them (known after :meth:`setup`)."""
        if self._devices_per_node is None:
            raise RuntimeError("Par3DEngine.devices_per_node is known after setup().")
        return self._devices_per_node

    @property
    def mesh(self) -> Par3DMesh:
        if self._mesh is None:
            raise RuntimeError("Accessing the par3d mesh before processes have initialized is not allowed.")
        return self._mesh

    @property
    def device(self) -> torch.device:
        if self._device is None:
            raise RuntimeError("The engine's device is known once Par3DEngine.setup() has run.")
        return self._device

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different slices of each global batch are read."""
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        """Which slice of each global batch this rank reads (tensor-parallel and pipeline peers read the same)."""
        return self.mesh.dp_rank(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.mesh.coords(self.rank).pp

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank computes the model's outputs and loss (always, without pipelining)."""
        return self.layout.pp == 1 or self.pp_rank == self.layout.last_stage_owner

    def barrier(self) -> None:
        """Waits for every rank (nothing before the process group exists). Under NCCL on the engine's device."""
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl" and self._device is not None and self._device.type == "cuda":
            dist.barrier(device_ids=[self._device.index])
        else:
            dist.barrier()

    # ---------------------------------------------------------------- the data-parallel ranks
    def sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` for a ``DistributedSampler``: the data-parallel ranks only."""
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def dp_group(self) -> Any:
        """This rank's data-parallel process group (its peers at the same pipeline stage and tp coordinate)."""
        return self.mesh["dp"].get_group()

    def reduce(self, tensor: torch.Tensor, op: Any = "mean") -> torch.Tensor:
        """``tensor`` reduced over the data-parallel ranks, the only ranks that hold different values of a logged
        number, for every front-end; ``op`` a name, a ``ReduceOp`` or None (:func:`collectives.reduce`)."""
        return collectives.reduce(tensor, op, self.layout, self.mesh, self.device)

    def metric_sync_fn(self) -> SyncFn:
        """The torchmetrics ``dist_sync_fn`` of this layout (:func:`lightning_par3d.engine.collectives.metric_sync`)."""
        return collectives.metric_sync(self.layout, self.mesh, self.rank)

    def attach_metrics(self, *modules: nn.Module) -> int:
        """Makes every torchmetrics metric in ``modules`` without a sync of its own sync over the right ranks
        (:meth:`metric_sync_fn`; :meth:`parallelize` does it for the model's own); returns how many."""
        if not self.holds_last_stage:
            quiet_compute_before_update()
        return attach_metric_sync(modules, self.metric_sync_fn(), pipelined=self.layout.pp > 1)

    # ---------------------------------------------------------------- when this rank fails
    def note_step(self, step: int) -> None:
        """Records the step this rank is starting, so that a failure can say how far each rank had come."""
        faults.note_step(self.rank, step)

    def describe_failure(self, error: BaseException) -> str:
        """Records this rank's failure; a message for a person (:mod:`lightning_par3d.distributed.faults`)."""
        self.failed = True
        world = self._layout.world_size if self._layout is not None else 1
        return faults.describe_failure(self.rank, world, error, self.config.timeout_s)

    def failed_first(self) -> bool:
        """After :meth:`describe_failure`: whether this rank's failure is the job's first (the one to print)."""
        return faults.failed_first(self.rank)
