"""The engine: everything a front-end needs to train one model at a par3d layout, in one framework-free object.

A front-end (the Lightning Trainer strategy, the Fabric strategy, the Accelerate ``Accelerator``, or a plain torch
loop) maps its framework's hooks onto these calls, in this order::

    engine = Par3DEngine(Par3DConfig(dp_shard=2, tp=2), precision="32-true")
    engine.resolve(world_size=4, device_type="cpu")   # before any process group: every check that can fail early
    engine.setup(torch.device("cpu"))                  # the default group (if nobody made it) and the mesh
    with engine.init_context():                        # real on rank 0, meta elsewhere (init="rank0")
        model = build_model()
    model = engine.parallelize(model)                  # TP, activation checkpointing, FSDP2/DDP, pipeline split
    [optimizer] = engine.setup_optimizers([torch.optim.AdamW(model.parameters())])   # ZeRO-1/2 wrapper if set
    for x, y in batches:                               # the sampler reads engine.dp_rank of engine.dp_size
        loss = engine.train_step(model, x, y, loss_fn)     # forward + backward, through the pipeline under pp
        engine.clip_grad_norm_(optimizer, 1.0)             # the norm over every tp, dp and pp shard
        optimizer.step(); optimizer.zero_grad()
    engine.save(path, {"step": step}, [engine.optimizer_state(optimizer)])   # DCP; optimizer_0, optimizer_1, …
    engine.teardown()                                  # closes hooks; the mesh stays for the next run

With ``Par3DConfig(layout="auto")`` the layout is chosen at launch: ``resolve`` checks what it can and ``setup``
joins the default group but builds no mesh; :meth:`choose_layout` (every rank, with the model and the batch's
shape) plans, and builds the mesh of the layout it chose.

A model parallelized once stays parallelized: :meth:`parallelize` called again with the same module (Lightning's
``fit`` then ``test``, a second ``fit``, a new engine in the same process) reuses it, and refuses it with a clear
error if the layout differs. One mesh per layout serves every run of that layout in the process
(:mod:`lightning_par3d.parallel.groups`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from lightning_par3d.checkpoint import dcp as ckpt
from lightning_par3d.checkpoint import hf as hf_checkpoint
from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.parallel import faults, groups
from lightning_par3d.parallel.compile import check_compile
from lightning_par3d.parallel.compression import check_compression_device
from lightning_par3d.parallel.data_parallel import no_gradient_sync
from lightning_par3d.parallel.gather import gather_objects, gather_tensors, map_tensors
from lightning_par3d.parallel.gradients import clip_grads_
from lightning_par3d.parallel.locality import launcher_devices_per_node, tp_across_nodes
from lightning_par3d.parallel.materialize import build_context
from lightning_par3d.parallel.mesh import Par3DMesh
from lightning_par3d.parallel.metric_sync import (
    SyncFn,
    attach_metric_sync,
    metric_sync_fn,
    quiet_compute_before_update,
)
from lightning_par3d.parallel.model_changes import record_of, remember
from lightning_par3d.parallel.optimizer_paths import use_per_tensor_path_where_mixed
from lightning_par3d.parallel.parallelize import ParallelizeReport, parallelize
from lightning_par3d.parallel.precision import PRECISIONS, check_precision
from lightning_par3d.pipeline.batches import check_epoch, epoch_shape, limited
from lightning_par3d.pipeline.runner import PendingPipelineOutput, PipelineRunner
from lightning_par3d.pipeline.trunk import PipelineHost, PipelineSpec, install_loss
from lightning_par3d.zero.optimizer import ZeroOptimizer, optimizer_grads, wrap_optimizers

LossFn = Callable[[Any, Any], torch.Tensor]

_MODEL_FIELDS = (
    "tp_plan",
    "fsdp_blocks",
    "split_points",
    "activation_checkpointing",
    "ac_every",
    "ac_blocks",
    "compile",
    "compile_options",
    "offload",
    "grad_compression",
    "init",
    "pretrained_path",
)
"""The config fields, beyond the layout, that shape a parallelized model: a module parallelized with other values
cannot be reused."""


MODEL_KEY = "state_dict"
"""The model's entry in a par3d checkpoint (Lightning's name for it)."""


def optimizer_key(index: int) -> str:
    """The ``index``-th optimizer's entry in a par3d checkpoint."""
    return f"optimizer_{index}"


@dataclass
class _ModelRecord:
    """What par3d did to one module, kept (weakly keyed by the module) for as long as the module lives. It holds
    nothing that refers back to the module, so that a module that is dropped is freed."""

    layout: Layout
    settings: tuple[tuple[str, Any], ...]
    pipeline: PipelineRunner | None
    spec: PipelineSpec | None
    structure: tuple[int, ...]
    report: ParallelizeReport
    host: weakref.ref[PipelineHost] | None = None
    """For a plain model pipelined in a host: the host (weakly; a new one is made if it is gone)."""


class Par3DEngine:
    """One model's distributed life at one par3d layout: validation, process groups and mesh, the build context,
    ``parallelize``, optimizer setup, the step (pipelined or not), gradient sync and clipping, sharded checkpoints
    and teardown. Independent of Lightning, Fabric and Accelerate; see the module docstring for the order of
    calls."""

    def __init__(self, config: Par3DConfig, precision: str = "32-true") -> None:
        resolve_layout(config)  # the checks that need no world size, now
        if precision not in PRECISIONS:
            check_precision(precision, zero_stage=0)
        self.config = config
        self.precision = precision
        self.accumulate_grad_batches = 1
        """Batches per optimizer step (gradient accumulation, Lightning's name); the pipeline scales its losses by
        it."""
        self.clear_grads_first = False
        """Set per batch by a front-end whose framework clears gradients only after the step function (Lightning):
        the pipeline then clears them before its backward, on the first batch of each accumulation window."""
        self._layout: Layout | None = None
        self._world: tuple[int, str] | None = None
        """The world size and device type :meth:`resolve` was given."""
        self._mesh: Par3DMesh | None = None
        self._device: torch.device | None = None
        self._devices_per_node: int | None = None
        self.relayout_note: str | None = None
        """Under ``elastic=True``, what :meth:`resolve` changed in the sizes to fit the world (None: nothing)."""
        self._backend = "gloo"
        self._module: nn.Module | None = None
        self._forward_module: nn.Module | None = None
        self._record: _ModelRecord | None = None
        self._zero: list[ZeroOptimizer] = []
        self._names_before: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._steps = 0

    # ---------------------------------------------------------------- before any process group
    def resolve(self, world_size: int, device_type: str = "cpu") -> Layout | None:
        """Validates the configuration against the world size, the precision and the device type, and fixes the
        layout (None under ``layout="auto"``, whose layout :meth:`choose_layout` fixes at launch). Raises
        ``ValueError`` listing every problem; call it before any process is launched."""
        self._world = (world_size, device_type)
        check_compression_device(self.config.grad_compression, device_type)
        if self.config.compile:
            check_compile(self.config.compile_options, device_type)
        if self.config.elastic:  # the sizes that still fit this world (lightning_par3d.elastic)
            from lightning_par3d.elastic import relayout

            self.config, self.relayout_note = relayout(self.config, world_size)
        if self.awaits_layout:
            from lightning_par3d.planning.at_launch import check_before_launch

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

    # ---------------------------------------------------------------- processes
    def setup(self, device: torch.device, backend: str | None = None, devices_per_node: int | None = None) -> None:
        """Initializes the default process group from the environment if nobody has (torchrun's variables), then
        takes the mesh for the layout (built, or shared with an earlier engine of the same layout); under
        ``layout="auto"`` the mesh waits for :meth:`choose_layout`. Every rank must call it. ``devices_per_node``
        (the launcher's processes per node: Lightning's ``devices``) defaults to torchrun's ``LOCAL_WORLD_SIZE``,
        then SLURM's ``SLURM_NTASKS_PER_NODE``, then the whole world (one node); rank 0 warns when tensor-parallel
        groups cross nodes (:mod:`lightning_par3d.parallel.locality`)."""
        import torch.distributed as dist

        self._device = device
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self._devices_per_node = devices_per_node or launcher_devices_per_node(world)
        if not self.is_resolved:
            self.resolve(world, device.type)
        self._backend = groups.init_default_group(device, self.config.timeout_s, backend)
        groups.set_collective_timeout(self.config.timeout_s)  # also when a front-end created the group
        if not self.awaits_layout:
            self._take_mesh()

    def calibrate(self) -> Any:
        """This job's machine figures (:class:`~lightning_par3d.planning.machine.Machine`), measured by every rank at
        once over the job's own process group (every rank must call it): what the planner predicts with at launch
        (``layout="auto"``) and the bottleneck report's advice at the end of fit."""
        import torch.distributed as dist

        from lightning_par3d.planning.calibrate import calibrate_job

        every_rank = list(range(dist.get_world_size()))
        return calibrate_job(self.device, groups.group_of(every_rank, self._backend, self.config.timeout_s))

    def _take_mesh(self) -> None:
        import torch.distributed as dist

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
        self, module: nn.Module | None, rank_batch: int, seq_len: int, devices_per_node: int | None = None
    ) -> Layout:
        """``layout="auto"``: plans the layout at launch (every rank, after :meth:`setup`, before the model is
        parallelized; see :mod:`lightning_par3d.planning.at_launch`), makes the chosen configuration this engine's,
        and builds its mesh. ``module`` is the model before ``configure_model`` (a LightningModule, or a factory of
        an ``nn.Module``), needed on rank 0 only; ``rank_batch`` and ``seq_len`` are a training batch's samples per
        data-parallel rank and tokens per sample; ``devices_per_node`` defaults to the launcher's
        devices per node :meth:`setup` found."""
        import torch.distributed as dist

        from lightning_par3d.planning.at_launch import choose_at_launch

        if not self.awaits_layout:
            raise RuntimeError("Par3DEngine.choose_layout() is for layout='auto', once, after setup().")
        world = dist.get_world_size()
        local = devices_per_node or self.devices_per_node
        self.config = choose_at_launch(
            self.config, module, world_size=world, devices_per_node=local, rank_batch=rank_batch, seq_len=seq_len,
            precision=self.precision, device=self.device, measure=self.calibrate,
        )  # fmt: skip
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
        import torch.distributed as dist

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

    # ---------------------------------------------------------------- the model
    @contextmanager
    def init_context(self) -> Iterator[None]:
        """Where the model is built: for real on rank 0 (on CPU) and on the meta device elsewhere with
        ``init="rank0"``, on meta everywhere with ``init="meta"``; seeded with ``config.seed`` if set."""
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        with build_context(self.config.init, self.rank):
            yield

    def parallelize(self, module: nn.Module) -> nn.Module:
        """Applies the layout to ``module`` (in place) and returns what to train: ``module``, or, for pure
        replication, ``DistributedDataParallel`` over it. Under pp > 1 a module that declares ``pipeline_trunk`` and
        ``pipeline_loss`` (a LightningModule) is pipelined as declared; any other model becomes the trunk of a
        :class:`~lightning_par3d.pipeline.trunk.PipelineHost`, which is returned (run it with :meth:`train_step`).

        A module this process has parallelized before is reused as it is, if its layout and settings are this
        engine's; otherwise a ``ValueError`` says what differs and what to do."""
        if self.layout.pp > 1 and not isinstance(module, PipelineHost) and not _declares_pipeline(module):
            return self._parallelize_hosted(module)
        record = record_of(module)
        if record is not None:
            return self._reuse(module, record)
        self._names_before = WeakIdKeyDictionary({p: n for n, p in module.named_parameters()})
        result = parallelize(module, self.mesh, self.config, self.device, self.precision)
        record = _ModelRecord(
            layout=self.layout,
            settings=self._settings(),
            pipeline=result.pipeline,
            spec=result.spec,
            structure=_structure(module),
            report=result.report,
        )
        remember(module, record)
        self._adopt(module, result.forward_module, record)
        return result.forward_module

    def _parallelize_hosted(self, model: nn.Module) -> nn.Module:
        """``model`` as the trunk of a pipeline host. The host is remembered weakly, so that parallelizing the same
        model again finds it (or puts a new host around the already pipelined model)."""
        record = record_of(model)
        if record is None:
            host = PipelineHost(model)
            trained = self.parallelize(host)
            remember(model, replace(record_of(host), host=weakref.ref(host)))
            return trained
        alive = record.host() if record.host is not None else None
        host = alive if alive is not None else PipelineHost(model)
        if alive is None:
            remember(host, record)
            remember(model, replace(record, host=weakref.ref(host)))
        return self.parallelize(host)

    def _reuse(self, module: nn.Module, record: _ModelRecord) -> nn.Module:
        differences = _differences(record, self.layout, self._settings())
        if differences:
            raise ValueError(
                f"{type(module).__name__} was already parallelized by par3d with other settings ("
                + "; ".join(differences)
                + "). A model is parallelized once. Build a fresh model for the new layout, or save a checkpoint "
                "and load it into a fresh model at the new layout."
            )
        if _structure(module) != record.structure:
            raise RuntimeError(
                f"{type(module).__name__} was parallelized by par3d, but its submodules have been replaced since "
                "(a `configure_model` that builds a new model each time it is called?). Build the model only once, "
                "e.g. `if self.model is None: self.model = ...`, as Lightning asks of configure_model."
            )
        trained = self._forward_module if self._module is module and self._forward_module is not None else None
        if trained is None and self.layout.data_parallel == "ddp":
            from lightning_par3d.parallel.data_parallel import replicate_with_ddp
            from lightning_par3d.parallel.parallelize import _compression

            trained = replicate_with_ddp(module, self.mesh, self.device, _compression(self.config))
        self._adopt(module, trained or module, record)
        return self.forward_module

    def _adopt(self, module: nn.Module, trained: nn.Module, record: _ModelRecord) -> None:
        self._module, self._forward_module, self._record = module, trained, record
        if record.spec is not None and not isinstance(module, PipelineHost):
            install_loss(module, record.spec.loss, self.run_pipeline)
        self.attach_metrics(module)

    def _settings(self) -> tuple[tuple[str, Any], ...]:
        values = {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name in _MODEL_FIELDS}
        values["precision"] = self.precision
        return tuple((k, repr(v)) for k, v in sorted(values.items()))

    @property
    def module(self) -> nn.Module:
        """The parallelized module (the user's object)."""
        if self._module is None:
            raise RuntimeError("No model yet: call Par3DEngine.parallelize(model) first.")
        return self._module

    @property
    def forward_module(self) -> nn.Module:
        """What to call for forward and backward: the module itself, or ``DistributedDataParallel`` over it (pure
        replication)."""
        if self._forward_module is None:
            raise RuntimeError("No model yet: call Par3DEngine.parallelize(model) first.")
        return self._forward_module

    @property
    def pipeline(self) -> PipelineRunner | None:
        """This rank's pipeline runner under pp > 1, else None."""
        return self._record.pipeline if self._record is not None else None

    @property
    def pipeline_spec(self) -> PipelineSpec | None:
        """The trunk and loss names the model declared for pipelining (None without pp, or for a hosted model)."""
        record = self._record
        if record is None or record.spec is None or isinstance(self._module, PipelineHost):
            return None
        return record.spec

    @property
    def report(self) -> ParallelizeReport:
        if self._record is None:
            raise RuntimeError("No model yet: call Par3DEngine.parallelize(model) first.")
        return self._record.report

    def describe(self) -> str:
        """One line for the log: the layout and what was applied."""
        return f"par3d: {self.layout} on {self.layout.world_size} ranks; {self.report}."

    # ---------------------------------------------------------------- optimizers
    def setup_optimizers(self, optimizers: Sequence[Optimizer], schedulers: Iterable[Any] = ()) -> list[Optimizer]:
        """The optimizers to step: each one over the parallelized parameters (an optimizer built before
        :meth:`parallelize` is pointed at them by parameter name), wrapped in a
        :class:`~lightning_par3d.zero.optimizer.ZeroOptimizer` under ZeRO-1/2 (LR schedulers bound to it follow the
        wrapper). Earlier ZeRO wrappers of this engine are closed."""
        self.close_optimizers()
        names: dict[torch.Tensor, str] = {p: n for n, p in self.module.named_parameters()}
        for optimizer in optimizers:
            self._point_at_parameters(optimizer)
            for line in use_per_tensor_path_where_mixed(optimizer, names):
                if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                    warnings.warn(f"par3d: {line}.", stacklevel=2)
        if self.layout.data_parallel != "zero":
            return list(optimizers)
        wrapped = wrap_optimizers(list(optimizers), schedulers, self.layout.zero, self.mesh)
        self._zero = list(wrapped)
        return wrapped

    def holds_stale_parameters(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` holds parameters of the model as it was before :meth:`parallelize`."""
        return any(p in self._names_before for g in optimizer.param_groups for p in g["params"])

    def _point_at_parameters(self, optimizer: Optimizer) -> None:
        """Replaces, in ``optimizer``'s groups, parameters of the model as it was before :meth:`parallelize` by the
        parallelized parameters of the same name (dropping those another pipeline stage holds)."""
        current = dict(self.module.named_parameters())
        mine = set(current.values())
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                if param in mine:
                    params.append(param)
                    continue
                name = self._names_before.get(param)
                if name is None:
                    raise ValueError(
                        f"{type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} that is not a "
                        "parameter of the parallelized model. Create the optimizer from model.parameters() after "
                        "parallelizing (or preparing) the model, or pass it together with the model."
                    )
                if name in current:
                    params.append(current[name])
            if optimizer.state and params != group["params"]:
                raise RuntimeError(
                    f"{type(optimizer).__name__} already stepped over the parameters of the model before it was "
                    "parallelized; its state cannot follow them. Create the optimizer before its first step."
                )
            group["params"] = params

    def close_optimizers(self) -> None:
        """Removes the gradient hooks of this engine's ZeRO wrappers."""
        for zero in self._zero:
            zero.close()
        self._zero = []

    @property
    def zero_optimizers(self) -> list[ZeroOptimizer]:
        return list(self._zero)

    # ---------------------------------------------------------------- steps
    def run_pipeline(
        self, pending: PendingPipelineOutput, targets: Any, loss_fn: LossFn, train: bool | None = None
    ) -> torch.Tensor:
        """Runs the pipeline schedule for one batch: forward and backward if ``train`` (by default: when the module
        is in training mode and gradients are enabled), forward only otherwise. Returns the batch's mean loss on
        every rank."""
        runner = self._require_pipeline()
        if train is None:
            train = self.module.training and torch.is_grad_enabled()
        return runner.run(
            pending,
            targets,
            loss_fn,
            train=train,
            device=self.device,
            accumulate=self.accumulate_grad_batches,
            zero_grad_first=self.clear_grads_first,
            zero=self._zero,
        )

    def train_step(
        self,
        model: nn.Module,
        inputs: Any,
        targets: Any,
        loss_fn: LossFn,
        backward: Callable[[torch.Tensor], Any] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch at any layout; returns the batch's mean loss (detached) on every rank.

        Without pipelining: ``loss = loss_fn(model(*inputs), targets)`` then ``backward(loss)`` (default
        ``loss.backward()``; a front-end passes its own, e.g. with loss scaling). Under pp: the schedule runs both,
        microbatched, the gradients accumulating into the parameters. ``inputs`` is a tensor, a tuple of positional
        arguments or a dict of keyword arguments.
        """
        self._steps += 1
        self.note_step(self._steps)
        if self.layout.pp == 1:
            with torch.enable_grad():
                loss = loss_fn(_call(model, inputs), targets)
            (backward or torch.Tensor.backward)(loss)
            return loss.detach()
        with torch.enable_grad():
            return self.run_pipeline(_pending(inputs), targets, loss_fn, train=True)

    def eval_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of one batch, forward only, at any layout (on every rank)."""
        with torch.no_grad():
            if self.layout.pp == 1:
                return loss_fn(_call(model, inputs), targets).detach()
            return self.run_pipeline(_pending(inputs), targets, loss_fn, train=False)

    def predict(self, pending: PendingPipelineOutput) -> Any:
        """Under pp: the trunk's outputs on the ranks holding the last stage, None elsewhere."""
        return self._require_pipeline().predict(pending, self.device)

    def predict_step(self, model: nn.Module, inputs: Any) -> Any:
        """The model's outputs for one batch, forward only, at any layout: ``inputs`` is a tensor, a tuple of
        positional arguments or a dict of keyword arguments, as in :meth:`train_step`. Under pp the outputs exist on
        the ranks holding the last stage; the others return None."""
        with torch.no_grad():
            if self.layout.pp == 1:
                return _call(model, inputs)
            return self.predict(_pending(inputs))

    def _require_pipeline(self) -> PipelineRunner:
        runner = self.pipeline
        if runner is None:
            raise RuntimeError("This model is not pipelined (pp=1): call it directly.")
        return runner

    @contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Backward passes inside keep their gradients local (the non-final batches of gradient accumulation):
        DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``, ZeRO-1's held all-reduce."""
        if not enabled:
            yield
            return
        with ExitStack() as stack:
            stack.enter_context(no_gradient_sync(self.forward_module))
            for zero in self._zero:
                stack.enter_context(zero.no_sync())
            yield

    def clip_grad_norm_(
        self, source: Optimizer | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Scales gradients so that their norm over every tp, dp and pp shard (the whole model's, as one process
        computes it) is at most ``max_norm``; returns the norm before clipping. ``source`` is the optimizer whose
        gradients to clip (the Trainer, Fabric), or parameters (Accelerate's ``clip_grad_norm_(model.parameters())``).
        Under ZeRO-2, where each rank holds only its rows of the gradients, those rows are clipped either way."""
        zero2 = [z for z in self._zero if z.stage == 2]
        if isinstance(source, Optimizer):
            grads = optimizer_grads(getattr(source, "_optimizer", source))  # Lightning's and Fabric's wrappers
        elif zero2:
            grads = [g for zero in zero2 for g in optimizer_grads(zero)]
        else:
            grads = [p.grad for p in source if p.grad is not None]
        pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        return clip_grads_(grads, float(max_norm), float(norm_type), pp_group)

    # ---------------------------------------------------------------- data and logged values
    def check_epoch(self, loader: Any, what: str, limits: Sequence[int | float] = ()) -> str | None:
        """Under pp, before the first step: raises ``ValueError`` if a batch of ``loader`` (a ``DataLoader`` as the
        front-end will shard it over the data-parallel ranks; of which the run reads at most ``limits`` batches,
        each a count or a fraction of the epoch) cannot be split into microbatches, and returns a line for the log
        if the epoch's partial last batch runs as fewer microbatches (:mod:`lightning_par3d.pipeline.batches`);
        None otherwise, or when the loader's epoch cannot be told."""
        runner = self.pipeline
        if runner is None:
            return None
        shape = epoch_shape(loader, self.dp_size)
        if shape is None:
            return None
        shape = limited(shape, *limits)
        note = check_epoch(shape, self.layout, what)
        if note is not None:
            runner.announced.add(shape.last_batch)
        return note

    def sampler_kwargs(self) -> dict[str, int]:
        """``num_replicas`` and ``rank`` for a ``DistributedSampler``: the data-parallel ranks only."""
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def dp_group(self) -> Any:
        """This rank's data-parallel process group (its peers at the same pipeline stage and tp coordinate)."""
        return self.mesh["dp"].get_group()

    def metric_sync_fn(self) -> SyncFn:
        """The torchmetrics ``dist_sync_fn`` for this layout: gather over the data-parallel ranks that hold the
        outputs, and hand the result to every pipeline stage (see :mod:`lightning_par3d.parallel.metric_sync`)."""
        if self.layout.pp == 1:
            return metric_sync_fn(self.dp_group())
        last = self.mesh.group_ranks("pp", self.rank)[self.layout.last_stage_owner]
        return metric_sync_fn(self.dp_group(), self.mesh["pp"].get_group(), last)

    def gather(self, data: Any, as_objects: bool = False) -> Any:
        """The batch values ``data`` of every data-parallel rank, on every rank: tensors (nested in lists, tuples or
        dicts) concatenated on the first dimension, or, with ``as_objects``, a list's items in rank order (pickled).
        Tensor-parallel peers hold the same samples and are not counted again. Under pp the values are the last
        stage's (the other stages may pass anything, None typically); they reach every pipeline rank."""
        group, size = self.dp_group(), self.dp_size
        if self.holds_last_stage:
            gathered = gather_objects(data, group, size) if as_objects else gather_tensors(data, group, size)
        else:
            gathered = None
        if self.layout.pp == 1:
            return gathered
        runner = self._require_pipeline()
        cpu = gathered if as_objects else map_tensors(lambda t: t.detach().cpu(), gathered)
        received = runner.broadcast_object_from_last_stage(cpu)
        return received if as_objects else map_tensors(lambda t: t.to(self.device), received)

    def attach_metrics(self, *modules: nn.Module) -> int:
        """Makes every torchmetrics metric in ``modules`` (a metric, a ``MetricCollection``, or a model holding
        them) sync over the right ranks (:meth:`metric_sync_fn`), unless it has a ``process_group`` or
        ``dist_sync_fn`` of its own; returns how many. :meth:`parallelize` does this for the model's own
        metrics."""
        if self.layout.pp > 1 and self.mesh.coords(self.rank).pp != self.layout.last_stage_owner:
            quiet_compute_before_update()
        return attach_metric_sync(modules, self.metric_sync_fn(), pipelined=self.layout.pp > 1)

    def reduce(self, tensor: torch.Tensor, op: Any = "mean") -> torch.Tensor:
        """``tensor`` reduced over the data-parallel ranks, the only ranks that hold different values of a logged
        number: tensor-parallel peers hold the same, and every pipeline rank holds the last stage's loss. ``op`` is
        a name (``"mean"`` or ``"avg"``, ``"sum"``, ``"max"``, ``"min"``), a ``torch.distributed.ReduceOp`` of
        those, or None (mean), as Lightning and Accelerate pass them. A new tensor; the same on every rank of the
        data-parallel group."""
        import torch.distributed as dist

        op = reduce_op_name(op)
        ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        result = tensor.detach().to(self.device, copy=True)
        if self.layout.dp > 1:
            dist.all_reduce(result, op=ops[op], group=self.dp_group())
        return result / self.layout.dp if op == "mean" else result

    # ---------------------------------------------------------------- checkpoints
    def _saved_module(self) -> nn.Module:
        """The module whose names a checkpoint uses: the model itself (inside DDP, inside a pipeline host), so that
        a checkpoint names parameters alike at every layout."""
        module = self.module
        return module.trunk if isinstance(module, PipelineHost) else self.forward_module

    def model_state(self) -> dict[str, Any]:
        """This rank's shards of the model's state (DTensors, nothing gathered), keyed by original names."""
        return ckpt.model_state(self._saved_module())

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's shards of ``optimizer``'s state, keyed by parameter name (``optimizer`` may be wrapped by
        Lightning, Fabric or Accelerate)."""
        return ckpt.optimizer_state(self._saved_module(), _unwrapped(optimizer))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state, unsharded, under its original names, on rank 0 (None elsewhere); a collective."""
        coords = self.mesh.coords(self.rank)
        first_copy = coords.dp_replicate == 0 and coords.dp_shard == 0 and coords.tp == 0
        return ckpt.full_state_dict(self._saved_module(), holds_copy=first_copy)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the Hugging Face transformers model inside the trained module as a ``save_pretrained`` directory
        (safetensors and ``config.json``, loadable with ``AutoModelForCausalLM.from_pretrained``), from any layout:
        the weights are gathered on rank 0, which writes them. Every rank must call it; every rank raises the same
        error if the writing fails, and returns the directory once it is complete."""
        import torch.distributed as dist

        state = self.full_state_dict()
        outcome: list[Any] = [None]
        if self.rank == 0:
            assert state is not None
            try:
                hf_checkpoint.save_pretrained(self._saved_module(), state, directory)
            except Exception as error:  # every rank must learn of it, or the others would wait for ever
                outcome[0] = f"{type(error).__name__}: {error}"
        if dist.is_initialized():
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise RuntimeError(f"save_pretrained to {directory} failed on rank 0: {outcome[0]}")
        return Path(directory)

    def save(
        self,
        path: str | Path,
        metadata: dict[str, Any],
        optimizer_states: Sequence[dict[str, Any]] | Mapping[str, dict[str, Any]] = (),
        model_state: dict[str, Any] | None = None,
        model_key: str = MODEL_KEY,
    ) -> None:
        """Saves this rank's shards of the model (``model_state``, by default :meth:`model_state`) and of the
        optimizers (their :meth:`optimizer_state`, under their names, or ``optimizer_0``, ``optimizer_1``, … for a
        list) with DCP, and ``metadata`` (rank 0's) as ``meta.pt``, atomically (see
        :mod:`lightning_par3d.checkpoint.dcp`). Every rank must call it."""
        tensors = {model_key: self.model_state() if model_state is None else model_state}
        tensors.update(_by_key(optimizer_states))
        ckpt.save_sharded(Path(path), tensors, metadata, self.rank, self.barrier)

    def load(
        self,
        path: str | Path,
        optimizers: Sequence[Any] | Mapping[str, Any] = (),
        model_key: str = MODEL_KEY,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restores the model's and ``optimizers``' shards in place from the checkpoint at ``path`` (saved at this
        layout or any other, by :meth:`save`, the optimizers named as there) and returns its ``meta.pt`` contents. A
        damaged or foreign checkpoint raises the same ``ValueError`` on every rank."""
        inner = {key: _unwrapped(optimizer) for key, optimizer in _by_key(optimizers).items()}
        return ckpt.load_sharded(Path(path), self._saved_module(), inner, model_key, strict, weights_only)

    def barrier(self) -> None:
        """Waits for every rank (nothing before the process group exists). Under NCCL on the engine's device."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl" and self._device is not None and self._device.type == "cuda":
            dist.barrier(device_ids=[self._device.index])
        else:
            dist.barrier()

    # ---------------------------------------------------------------- faults
    def note_step(self, step: int) -> None:
        """Records the step this rank is starting, so that a failure can say how far each rank had come."""
        faults.note_step(self.rank, step)

    def describe_failure(self, error: BaseException) -> str:
        """A message for a person: this rank's error, the rank that failed first, and, when a collective timed out,
        the step each rank had started (which names a stalled rank). Records this rank's failure."""
        world = self._layout.world_size if self._layout is not None else 1
        return faults.describe_failure(self.rank, world, error, self.config.timeout_s)

    def failed_first(self) -> bool:
        """After :meth:`describe_failure`: whether this rank's failure is the job's first (the one to print)."""
        return faults.failed_first(self.rank)

    # ---------------------------------------------------------------- the end
    def teardown(self) -> None:
        """Closes the ZeRO wrappers' gradient hooks. Runs no collective (after a failure the other ranks may be gone
        or stuck). The mesh stays for the next run of this layout in this process, and a parallelized model stays
        usable (see :mod:`lightning_par3d.parallel.groups`)."""
        self.close_optimizers()


def _structure(module: nn.Module) -> tuple[int, ...]:
    """The identities of the module's submodules (a host's: its model's), to tell a rebuilt model from the one
    that was parallelized."""
    if isinstance(module, PipelineHost):
        module = module.trunk
    return tuple(id(m) for m in module.modules())


def _declares_pipeline(module: nn.Module) -> bool:
    return isinstance(getattr(module, "pipeline_trunk", None), str)


def _differences(record: _ModelRecord, layout: Layout, settings: tuple[tuple[str, Any], ...]) -> list[str]:
    found = []
    if record.layout != layout:
        found.append(f"layout then: {record.layout} (ZeRO-{record.layout.zero}), now: {layout} (ZeRO-{layout.zero})")
    for (name, then), (_, now) in zip(record.settings, settings, strict=True):
        if then != now:
            found.append(f"{name} then: {then}, now: {now}")
    return found


def reduce_op_name(op: Any) -> str:
    """The name of a reduction as Lightning, Fabric or Accelerate pass it: None (mean), a string (``"avg"`` is
    ``"mean"``; case does not matter) or a ``torch.distributed.ReduceOp``. Raises ``ValueError`` for others."""
    import torch.distributed as dist

    if op is None:
        return "mean"
    if isinstance(op, str):
        name = {"avg": "mean"}.get(op.lower(), op.lower())
    else:
        names = {
            dist.ReduceOp.SUM: "sum",
            dist.ReduceOp.MAX: "max",
            dist.ReduceOp.MIN: "min",
            dist.ReduceOp.AVG: "mean",
        }
        name = names.get(op, repr(op))
    if name not in ("mean", "sum", "max", "min"):
        raise ValueError(f"reduce op {op!r} is not one of 'mean' ('avg'), 'sum', 'max', 'min'.")
    return name


def _by_key(items: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """Optimizers (or their states) by their checkpoint keys: a mapping's own, or ``optimizer_<i>`` for a list."""
    if isinstance(items, Mapping):
        return dict(items)
    return {optimizer_key(i): item for i, item in enumerate(items)}


def _unwrapped(optimizer: Any) -> Any:
    """The torch (or ZeRO) optimizer inside Lightning's, Fabric's or Accelerate's optimizer wrapper."""
    for attr in ("_optimizer", "optimizer"):
        inner = getattr(optimizer, attr, None)
        if isinstance(inner, Optimizer):  # a ZeroOptimizer is one too, and is kept (its `wrapped` is not unwrapped)
            return _unwrapped(inner)
    return optimizer


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _pending(inputs: Any) -> PendingPipelineOutput:
    if isinstance(inputs, Mapping):
        return PendingPipelineOutput((), dict(inputs))
    if isinstance(inputs, tuple):
        return PendingPipelineOutput(inputs, {})
    return PendingPipelineOutput((inputs,), {})
