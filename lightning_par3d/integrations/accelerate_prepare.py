"""``Par3DAccelerator.prepare``: Accelerate's ``prepare`` for the model, optimizers, schedulers and dataloaders,
each through the engine.

* the model: par3d's ``parallelize`` (the plan, activation checkpointing, FSDP2/HSDP/DDP, the pipeline split); a
  plain model under pp becomes the trunk of a pipeline host that ``train_step`` runs through the schedule;
* an optimizer: pointed at the parallelized parameters (one built over the model before ``prepare`` is pointed at
  them by name), wrapped in par3d's ZeRO-1/2 optimizer where configured, then in Accelerate's;
* a scheduler: one step per optimizer step, following a ZeRO wrapper's parameter groups;
* a dataloader: split over the data-parallel processes only (tensor and pipeline peers read the same batches).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import convert_outputs_to_fp32
from accelerate.utils.modeling import get_mixed_precision_context_manager
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.rebatching import with_batch_size
from lightning_par3d.engine.tokens import read_ahead
from lightning_par3d.integrations.framework_private import prepared_models, prepared_optimizers
from lightning_par3d.pipeline.trunk import PipelineHost
from lightning_par3d.planning.at_launch import batch_shape, meta_copy, surrogate_loss
from lightning_par3d.planning.measuring import measure_with
from lightning_par3d.utils.model_changes import set_attribute


class PreparedForPar3D(Accelerator):
    """Mixed into :class:`~lightning_par3d.integrations.accelerator.Par3DAccelerator` (which sets ``engine``,
    ``_prepared`` and ``_prepared_in_this_call``)."""

    engine: Par3DEngine
    _prepared: list[nn.Module]
    _prepared_in_this_call: list[nn.Module]

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``: models, then optimizers (pointed at the prepared parameters), schedulers and
        dataloaders, in one call or several."""
        self._prepared_in_this_call = []
        if self.engine.awaits_layout:
            args = self._choose_layout(args)
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._prepared_in_this_call = []

    def _choose_layout(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``layout="auto"``: the layout chosen here, for the first model among ``args`` and the shape of a batch of
        their first dataloader (or ``plan_batch``); returns ``args`` with that dataloader re-made at the per-rank
        batch size that keeps the global batch at the chosen data-parallel size."""
        model = next((arg for arg in args if isinstance(arg, nn.Module)), None)
        if model is None:
            raise RuntimeError(
                "layout='auto' chooses the layout when the model is prepared: pass the model (and its training "
                "dataloader) to the first prepare() call."
            )
        loader = next((arg for arg in args if isinstance(arg, DataLoader)), None)
        rank_batch, seq_len = batch_shape(self.engine.config, loader, "prepare()'s arguments")
        copied = meta_copy(model)
        sample = measure_with(self.engine.config, copied, loader, surrogate_loss, self.project_dir)
        self.engine.choose_layout(copied if self.is_main_process else None, rank_batch, seq_len, sample=sample)
        split = self.engine.batch_split
        if loader is None or split is None:
            return args
        return tuple(with_batch_size(arg, split.rank_batch) if arg is loader else arg for arg in args)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Applies the layout (tensor parallel, activation checkpointing, FSDP2/HSDP/DDP, pipeline split) through
        the engine. A plain model under pp becomes the trunk of a pipeline host: run it with :meth:`train_step`."""
        if any(model is seen for seen in self._prepared) or isinstance(model, PipelineHost):
            raise RuntimeError(
                f"{type(model).__name__} has been prepared already; prepare each model once and keep the returned "
                "object."
            )
        trained = self.engine.parallelize(model)
        self._prepared += [model, trained]
        self._prepared_in_this_call.append(model)
        if self.native_amp:  # autocast around the forward, outputs in fp32: Accelerate's own wrapping
            target = self.engine.module
            autocast = get_mixed_precision_context_manager(self.native_amp, self.autocast_handler)
            set_attribute(target, "forward", convert_outputs_to_fp32(autocast(target.forward)))
        trained._is_accelerate_prepared = True  # type: ignore[assignment]
        prepared_models(self).append(trained)
        return trained

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> Optimizer:
        """``optimizer`` over the parallelized parameters (one built over the model before ``prepare`` is pointed
        at them by name), wrapped in par3d's ZeRO-1/2 optimizer where configured, and in Accelerate's."""
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return optimizer
        if not prepared_models(self):
            raise RuntimeError(
                "Prepare the model before (or together with) its optimizer: par3d replaces the model's parameters "
                "with their shards, and the optimizer must follow them."
            )
        if not self._prepared_in_this_call and self.engine.holds_stale_parameters(optimizer):
            raise ValueError(
                f"{type(optimizer).__name__} was created over the model's parameters as they were before `prepare`, "
                "which par3d has replaced with their shards. Create it from the prepared model's parameters "
                "(`model.parameters()` after `prepare`), or pass it to the same `prepare` call as the model."
            )
        [inner] = self.engine.setup_optimizers([optimizer])
        wrapped = AcceleratedOptimizer(inner, device_placement=False, scaler=self.scaler)
        prepared_optimizers(self).append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """One scheduler step per optimizer step (Accelerate's default steps it once per process)."""
        if getattr(scheduler, "_is_accelerate_prepared", False):
            return scheduler
        optimizers: Any = prepared_optimizers(self)
        for optimizer in prepared_optimizers(self):
            inner = optimizer.optimizer
            if scheduler.optimizer in (inner, getattr(inner, "wrapped", None)):
                scheduler.optimizer = inner  # a ZeRO wrapper shares the wrapped optimizer's parameter groups
                optimizers = optimizer
        prepared = AcceleratedScheduler(
            scheduler, optimizers, step_with_optimizer=self.step_scheduler_with_optimizer, split_batches=True
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None, **kwargs: Any
    ) -> Any:
        """Shards the data over the data-parallel processes only: tensor-parallel and pipeline peers read the same
        batches."""
        if getattr(data_loader, "_is_accelerate_prepared", False):
            if data_loader not in self._dataloaders:
                self._dataloaders.append(data_loader)
            return data_loader
        prepared = prepare_data_loader(
            data_loader,
            self.device,
            num_processes=self.engine.dp_size,
            process_index=self.engine.dp_rank,
            split_batches=self.split_batches,
            put_on_device=self.device_placement if device_placement is None else device_placement,
            rng_types=self.rng_types.copy(),
            dispatch_batches=False,
            even_batches=self.even_batches,
            use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader,
            torch_device_mesh=None,
        )
        # under loss_mean="tokens" the loader beneath Accelerate's reads each accumulation window ahead, so that
        # Accelerate's own look-ahead (the end of the dataloader, the last window's sync, gather_for_metrics) stays as
        # it is. DataLoaderShard calls `self.base_dataloader.__iter__()` and answers `__class__` with the base's, so
        # the base keeps its type and takes the windows' iterator as an instance attribute.
        windows = read_ahead(self.engine.token_mean, prepared.base_dataloader)
        if windows is not prepared.base_dataloader:
            prepared.base_dataloader.__iter__ = windows.__iter__
        self._dataloaders.append(prepared)
        return prepared
