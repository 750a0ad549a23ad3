"""``Fabric(strategy="par3d")``: thin Fabric glue over :class:`~lightning_par3d.engine.Par3DEngine`.

Build the model under ``fabric.init_module()`` (real on rank 0, meta elsewhere with the default
``init="rank0"``), then ``model = fabric.setup_module(model)`` and create the optimizer from the parallelized
parameters::

    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    loss = fabric.strategy.train_step(model, x, y, loss_fn)   # forward + backward at any layout

With gradient accumulation, set ``fabric.strategy.accumulate_grad_batches = n`` and step every ``n`` batches:
``train_step`` then scales each batch's backward as Lightning's Trainer does (and, under ``loss_mean="tokens"``,
takes the window's token mean from the dataloaders of ``fabric.setup_dataloaders``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.config import Par3DConfig, field_keywords
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.tokens import read_ahead
from lightning_par3d.integrations import lightning_shared as shared
from lightning_par3d.integrations.framework_private import (
    BackwardSyncControl,
    FabricScriptLauncher,
    all_gather_over,
    sync_over,
)
from lightning_par3d.integrations.lightning_checkpoints import FabricCheckpointHooks
from lightning_par3d.integrations.lightning_data import rebatched
from lightning_par3d.integrations.registry import register_fabric_strategy
from lightning_par3d.parallel.precision import precision_name
from lightning_par3d.planning.at_launch import meta_copy


class Par3DFabricStrategy(shared.LightningFrontEnd, FabricCheckpointHooks):
    """The Fabric counterpart of :class:`~lightning_par3d.integrations.trainer.Par3DStrategy`; same settings, same
    engine, same checkpoint layout: a :class:`~lightning_par3d.config.Par3DConfig`, or its fields as typed keyword
    arguments."""

    launcher_class = FabricScriptLauncher

    @field_keywords
    def __init__(
        self,
        config: Par3DConfig | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        **settings: Any,  # Par3DConfig's fields (field_keywords puts them in the signature)
    ) -> None:
        self.engine = shared.engine_for(type(self).__name__, config, settings)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._backward_sync_control = _Par3DBackwardSyncControl(self.engine)

    def _note_precision(self) -> None:
        self.engine.precision = precision_name(self.precision)

    @property
    def accumulate_grad_batches(self) -> int:
        """Batches per optimizer step in the user's loop (default 1): :meth:`train_step` divides each batch's
        backward by it (the pipeline scales its losses alike), as the Trainer does for its own."""
        return self.engine.accumulate_grad_batches

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, batches: int) -> None:
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"accumulate_grad_batches={batches!r} must be a positive integer (batches per step).")
        self.engine.accumulate_grad_batches = batches

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @override
    def setup_environment(self) -> None:
        self.resolve_world()  # raises before the process group exists if the sizes do not fit
        super().setup_environment()
        self.start_distributed()
        shared.end_job_on_uncaught_exception(self._launcher, self.engine)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Real tensors on rank 0 and meta elsewhere (``init="rank0"``), whatever ``empty_init`` says: the weights
        then equal a single process's, and only rank 0 ever holds a full copy."""
        stack = ExitStack()
        stack.enter_context(self.engine.init_context())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module(self, module: Module) -> Module:
        """Parallelizes ``module``. Under pp > 1 it becomes the trunk of a pipeline host that :meth:`train_step`
        runs through the schedule. Under ``layout="auto"`` the layout is chosen here first, for ``plan_batch``
        (Fabric has no dataloader yet)."""
        if self.engine.awaits_layout:
            planned = self.engine.config.plan_batch
            self._planned_batch = planned[0] if planned else None
            self.plan_layout(meta_copy(module), None, "Fabric, which sets up the model before any dataloader,")
        trained = self.engine.parallelize(module)
        shared.point_at_device(self.engine.module, self.root_device)
        rank_zero_info(self.engine.describe())
        return trained

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer`` over the parallelized parameters; under zero_stage 1 or 2 wrapped in a
        :class:`~lightning_par3d.zero.optimizer.ZeroOptimizer`."""
        return self.engine.setup_optimizers([optimizer])[0]

    def train_step(self, module: Module, inputs: Any, targets: Tensor, loss_fn: Callable[[Any, Any], Tensor]) -> Tensor:
        """Forward and backward of one batch at any layout (:meth:`Par3DEngine.train_step
        <lightning_par3d.engine.Par3DEngine.train_step>`): under pp > 1 inside the pipeline schedule (microbatched,
        gradients accumulated into the parameters), otherwise ``fabric.backward(loss)``. Returns the batch's loss on
        every rank (under ``loss_mean="tokens"`` its share of the step's global token mean: averaged over the
        data-parallel ranks and the window's batches, that mean). The script is the same at every layout:
        ``loss = fabric.strategy.train_step(model, x, y, loss_fn)``, then the optimizer step as usual. ``inputs``: a
        tensor, a tuple of arguments or a dict of keyword arguments."""
        refuse_whole_module_compile(module)
        self.engine.start_batch()
        with self.precision.forward_context():
            return self.engine.train_step(
                module, inputs, targets, loss_fn, lambda loss: self.backward(loss * self._backward_part(), module)
            )

    def _backward_part(self) -> float:
        """The part of a batch's loss its backward takes: ``1/accumulation`` of a mean, ``1/w`` of a token-mean
        share (:mod:`lightning_par3d.engine.tokens`)."""
        if self.engine.token_mean is None:
            return 1.0 / self.engine.accumulate_grad_batches
        return self.engine.backward_factor(1)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Under ``layout="auto"``, a dataloader whose ``batch_size`` is the planned one (``plan_batch``'s) re-made at
        the per-rank batch size that keeps the global batch at the chosen data-parallel size; under
        ``loss_mean="tokens"``, each dataloader read one accumulation window ahead
        (:func:`~lightning_par3d.engine.tokens.read_ahead`; Fabric cannot tell a training loader from another)."""
        split, planned = self.engine.batch_split, getattr(self, "_planned_batch", None)
        if split is not None and getattr(dataloader, "batch_size", None) == planned != split.rank_batch:
            dataloader = rebatched(self.engine, dataloader)
        return read_ahead(self.engine.token_mean, dataloader)

    def eval_step(self, module: Module, inputs: Any, targets: Tensor, loss_fn: Callable[[Any, Any], Tensor]) -> Tensor:
        """The mean loss of one batch, forward only, at any layout (on every rank)."""
        with self.precision.forward_context():
            return self.engine.eval_step(module, inputs, targets, loss_fn)

    def predict_step(self, module: Module, inputs: Any) -> Any:
        """The model's outputs for one batch, forward only: under pp on the ranks holding the last stage (None on
        the others)."""
        with self.precision.forward_context():
            return self.engine.predict_step(module, inputs)

    def sync_metrics(self, *metrics: Module) -> int:
        """Makes torchmetrics metrics (a metric, a ``MetricCollection``, or a module holding them) sync over the
        data-parallel ranks that hold the model's outputs, and give every rank the result: ``compute()`` then
        returns the single-process value at any layout. Metrics inside the model get this at ``setup_module``;
        returns how many metrics were set. Under pp, update them in the loss function (it runs where the outputs
        are)."""
        return self.engine.attach_metrics(*metrics)

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None) -> Any:
        raise NotImplementedError(
            "par3d replaces the model's parameters with their shards, so an optimizer created before setup would "
            "hold stale tensors. Call `model = fabric.setup_module(model)` first, then create the optimizer from "
            "`model.parameters()` and call `fabric.setup_optimizers(optimizer)`."
        )

    @override
    def module_to_device(self, module: Module) -> None:
        pass

    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        """``fabric.all_reduce``: over the data-parallel ranks, as the Trainer's ``reduce`` (``self.log(...,
        sync_dist=True)``) and ``Par3DAccelerator.reduce``: tensor-parallel peers and pipeline stages read the same
        samples, so a sum over the whole world would count each of them tp × pp times. Every front-end gives one
        process's number. With a ``group`` other than the world (which ``fabric.all_reduce`` passes when given
        none): over that group, as Lightning does."""
        if not isinstance(tensor, Tensor):
            return tensor
        if not _is_the_world(group):
            return sync_over(tensor, group, reduce_op=reduce_op)
        return self.engine.reduce(tensor, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """``fabric.all_gather``: each data-parallel rank's ``tensor``, stacked (``(dp, *shape)``), for the same
        reason as :meth:`all_reduce`; with a ``group`` other than the world, over that group, as Lightning does."""
        if _is_the_world(group):
            if self.engine.layout.dp_cp == 1:
                return tensor.unsqueeze(0)
            group = self.engine.mesh["dp"].get_group()
        return all_gather_over(tensor, group, sync_grads=sync_grads)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clips by the norm over every shard: see :meth:`Par3DEngine.clip_grad_norm_
        <lightning_par3d.engine.Par3DEngine.clip_grad_norm_>`."""
        self.precision.unscale_gradients(optimizer)
        norm = self.engine.clip_grad_norm_(optimizer, float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of the gradients is {norm.item()}; it must be finite to clip by it.")
        return norm


class _Par3DBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: DDP's or FSDP2's gradient sync off, and ZeRO-1's all-reduce."""

    def __init__(self, engine: Par3DEngine) -> None:
        self.engine = engine

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self.engine.no_sync(enabled)


register_fabric_strategy(Par3DFabricStrategy)  # "par3d" in Lightning's registry, whoever imported this module


def _is_the_world(group: Any) -> bool:
    """Whether ``group`` means no group in particular: None, or the world, which Fabric passes when given none."""
    return group is None or group is torch.distributed.group.WORLD


def refuse_whole_module_compile(module: Module) -> None:
    """Refuses a model set up as ``fabric.setup(torch.compile(model))``: Fabric compiles the whole module after
    par3d's setup, around the pipeline host, the FSDP2 hooks and the stages (which then run uncompiled under pp),
    where par3d compiles each block in place (``compile=True``)."""
    inner = getattr(module, "_forward_module", module)
    if isinstance(inner, torch.nn.Module) and hasattr(inner, "_orig_mod"):  # torch.compile's OptimizedModule
        raise ValueError(
            "fabric.setup(torch.compile(model)) compiles the whole module after par3d has parallelized it: around "
            "the pipeline schedule (whose stages then run uncompiled), the FSDP2 hooks and the tensor-parallel "
            "modules. Set the model up uncompiled and let par3d compile each block in place: "
            "Par3DFabricStrategy(..., compile=True) (options: compile_options={...}), then "
            "model = fabric.setup(model)."
        )
