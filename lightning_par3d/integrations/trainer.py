"""``Trainer(strategy="par3d")``: thin Lightning glue over :class:`~lightning_par3d.engine.Par3DEngine`."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_par3d.config import Par3DConfig, field_keywords
from lightning_par3d.integrations import lightning_shared as shared
from lightning_par3d.integrations.lightning_checkpoints import ShardedCheckpoints
from lightning_par3d.integrations.lightning_collectives import LayoutCollectives
from lightning_par3d.integrations.lightning_logging import LogRelay
from lightning_par3d.integrations.lightning_pipeline import HeldGradients, PipelinedSteps
from lightning_par3d.integrations.lightning_precision import Par3DPrecision, as_par3d_precision
from lightning_par3d.integrations.lightning_summary import use_par3d_summary
from lightning_par3d.integrations.registry import register_trainer_strategy
from lightning_par3d.parallel.precision import precision_name
from lightning_par3d.pipeline.trunk import install_loss
from lightning_par3d.planning.at_launch import meta_copy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Par3DStrategy(shared.LightningFrontEnd, PipelinedSteps, ShardedCheckpoints, LayoutCollectives, ParallelStrategy):
    """Trains an unchanged LightningModule at any mix of data, tensor and pipeline parallelism.

    Give the settings either as a :class:`~lightning_par3d.config.Par3DConfig` or as its fields::

        Trainer(devices=4, strategy=Par3DStrategy(dp_shard=2, tp=2))

    Each field is a typed keyword argument with the config's default (documented on
    :class:`~lightning_par3d.config.Par3DConfig`), so IDEs, mypy and LightningCLI (``--trainer.strategy.tp=2``, or
    ``init_args`` in its YAML) see them; a list or dict field's None means its empty default.

    The LightningModule builds its model in ``configure_model`` (for real on rank 0 only, with ``init="rank0"``);
    :meth:`Par3DEngine.parallelize <lightning_par3d.engine.Par3DEngine.parallelize>` then applies the layout. The
    configuration is validated when the strategy is created and again, with the world size, before any process is
    launched. Mixins: the parts shared with Fabric (``lightning_shared.LightningFrontEnd``), the pipelined steps
    (``lightning_pipeline``), the sharded checkpoints (``lightning_checkpoints``) and the collectives
    (``lightning_collectives``).
    """

    strategy_name = "par3d"
    launcher_class = _SubprocessScriptLauncher

    @field_keywords
    def __init__(
        self,
        config: Par3DConfig | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **settings: Any,  # Par3DConfig's fields (field_keywords puts them in the signature)
    ) -> None:
        self.engine = shared.engine_for(type(self).__name__, config, settings)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._process_group_backend = process_group_backend
        self._held_grads = HeldGradients()  # see PipelinedSteps
        self._plan_copy: Any = None  # layout="auto": the module before configure_model, on rank 0
        self.num_nodes = 1

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.device_mesh

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self.precision_plugin = Par3DPrecision()
        assert self._precision_plugin is not None
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        """Lightning's plugin for ``precision=`` becomes par3d's counterpart (global-norm clipping); an unsupported
        precision raises here, before any process is launched."""
        plugin = as_par3d_precision(precision_plugin) if precision_plugin is not None else None
        if plugin is not None:
            plugin.engine = self.engine  # type: ignore[attr-defined]
            self.engine.precision = precision_name(plugin)
        self._precision_plugin = plugin

    @property
    def precision(self) -> str:
        """Lightning's ``precision=`` value in use (``"32-true"``, ``"bf16-mixed"``, …)."""
        return self.engine.precision

    @override
    def setup_environment(self) -> None:
        self.resolve_world()  # raises before the process group exists if the sizes do not fit
        self.check_elastic_launch()
        super().setup_environment()
        self.start_distributed()
        module = self.lightning_module
        assert module is not None
        if self.engine.awaits_layout:  # layout="auto": planned in setup, with the module before configure_model
            self._plan_copy = meta_copy(module)
        else:
            module._device_mesh = self.device_mesh

    # ---------------------------------------------------------------- model
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``configure_model`` builds the model: see :meth:`Par3DEngine.init_context
        <lightning_par3d.engine.Par3DEngine.init_context>`."""
        with self.engine.init_context(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        # No convert_module: under "bf16-true" the model was built in bf16 (tensor_init_context), and FSDP2 modules
        # must not be cast after sharding.
        module = self.lightning_module
        assert module is not None
        if self.engine.awaits_layout:  # Lightning's own resolution of the training data
            self.plan_layout(self._plan_copy, trainer.fit_loop._data_source.dataloader(), "the training dataloader")
            module._device_mesh = self.device_mesh
        self.model = self.engine.parallelize(module)
        shared.point_at_device(module, self.root_device)
        spec = self.engine.pipeline_spec
        if spec is not None:  # what the loss logs on the last stage, every stage logs
            install_loss(module, spec.loss, LogRelay(self.engine, module))
        if self.engine.relayout_note:
            rank_zero_info(f"par3d {self.engine.relayout_note}")
        rank_zero_info(self.engine.describe())
        self.engine.accumulate_grad_batches = trainer.accumulate_grad_batches
        self._check_epochs(trainer)
        use_par3d_summary(trainer)  # the whole model's counts at any layout, no FLOPs of 0
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _check_epochs(self, trainer: pl.Trainer) -> None:
        """Under pp: the batches of this run's dataloaders, checked against the microbatches before the first step
        (:meth:`Par3DEngine.check_epoch <lightning_par3d.engine.Par3DEngine.check_epoch>`): a batch that cannot be
        split fails here, and a partial last batch that runs as fewer microbatches is said once."""
        if self.engine.pipeline is None:
            return
        for source, what, limits in _data_sources(trainer):
            if not source.is_defined() or 0 in limits:
                continue
            loaders = source.dataloader()
            for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
                note = self.engine.check_epoch(loader, what, limits)
                if note is not None:
                    rank_zero_info(f"par3d: {note}")

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The LightningModule's optimizers, through :meth:`Par3DEngine.setup_optimizers
        <lightning_par3d.engine.Par3DEngine.setup_optimizers>` (ZeRO-1/2 wrappers; schedulers follow them)."""
        super().setup_optimizers(trainer)
        schedulers = [config.scheduler for config in self.lr_scheduler_configs]
        self.optimizers = self.engine.setup_optimizers(self.optimizers, schedulers)

    @override
    def model_to_device(self) -> None:  # parallelize() materialized every shard on the device already
        assert self.model is not None
        if not self.config.offload:  # offloaded shards stay in CPU memory
            self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skips the gradient reduction on the non-final batches of ``accumulate_grad_batches``."""
        with self.engine.no_sync():
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A rank that raises ends the whole job promptly: it says which rank failed first and why (and, for a
        collective that timed out, which rank fell behind), and kills the local ranks it launched."""
        if shared.is_failure(exception) and not isinstance(exception, KeyboardInterrupt):
            shared.end_failed_job(self._launcher, self.engine, exception)

    @override
    def teardown(self) -> None:
        self._held_grads.restore()
        self.engine.teardown()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _data_sources(trainer: pl.Trainer) -> list[tuple[Any, str, tuple[int | float, ...]]]:
    """The (data source, its name, the limits on the batches the run reads of it) of each dataloader the trainer's
    current run reads: Lightning's ``limit_*_batches``, and for training ``max_steps`` in batches."""
    fn = trainer.state.fn
    if fn == TrainerFn.FITTING:
        train_limits: tuple[int | float, ...] = (trainer.limit_train_batches or 0,)
        if trainer.max_steps > 0:
            train_limits += (trainer.max_steps * trainer.accumulate_grad_batches,)
        return [
            (trainer.fit_loop._data_source, "the training dataloader", train_limits),
            (trainer.fit_loop.epoch_loop.val_loop._data_source, "the validation dataloader",
             (trainer.limit_val_batches or 0,)),
        ]  # fmt: skip
    loops: dict[TrainerFn, tuple[Any, str, Any]] = {
        TrainerFn.VALIDATING: (trainer.validate_loop, "the validation dataloader", trainer.limit_val_batches),
        TrainerFn.TESTING: (trainer.test_loop, "the test dataloader", trainer.limit_test_batches),
        TrainerFn.PREDICTING: (trainer.predict_loop, "the predict dataloader", trainer.limit_predict_batches),
    }
    if fn not in loops:
        return []
    loop, what, limit = loops[fn]
    return [(loop._data_source, what, (limit or 0,))]


register_trainer_strategy(Par3DStrategy)  # "par3d" in Lightning's registry, whoever imported this module
