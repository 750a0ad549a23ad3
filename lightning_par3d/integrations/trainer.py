"""``Trainer(strategy="par3d")``: thin Lightning glue over :class:`~lightning_par3d.engine.Par3DEngine`."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_par3d.config import Par3DConfig, field_keywords
from lightning_par3d.engine.tokens import read_ahead
from lightning_par3d.integrations import lightning_shared as shared
from lightning_par3d.integrations.framework_private import sync_over
from lightning_par3d.integrations.lightning_checkpoints import TrainerCheckpointHooks
from lightning_par3d.integrations.lightning_compile import TakesCompiledModules
from lightning_par3d.integrations.lightning_data import check_epochs, rebatched
from lightning_par3d.integrations.lightning_elastic import ElasticRun
from lightning_par3d.integrations.lightning_launcher import Par3DLauncher
from lightning_par3d.integrations.lightning_logging import LogRelay
from lightning_par3d.integrations.lightning_pipeline import HeldGradients, PipelinedTrainingSteps
from lightning_par3d.integrations.lightning_precision import UsesPar3DPrecision
from lightning_par3d.integrations.lightning_summary import use_par3d_summary
from lightning_par3d.integrations.registry import register_trainer_strategy
from lightning_par3d.pipeline.trunk import install_loss
from lightning_par3d.planning.at_launch import meta_copy
from lightning_par3d.planning.measuring import measure_with

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Par3DStrategy(
    TakesCompiledModules, shared.LightningFrontEnd, PipelinedTrainingSteps, TrainerCheckpointHooks, UsesPar3DPrecision
):
    """Trains an unchanged LightningModule at any mix of data, tensor and pipeline parallelism.

    Give the settings either as a :class:`~lightning_par3d.config.Par3DConfig` or as its fields::

        Trainer(devices=4, strategy=Par3DStrategy(dp_shard=2, tp=2))

    Each field is a typed keyword argument with the config's default (documented on
    :class:`~lightning_par3d.config.Par3DConfig`), so IDEs, mypy and LightningCLI (``--trainer.strategy.tp=2``, or
    ``init_args`` in its YAML) see them; a list or dict field's None means its empty default.

    The LightningModule builds its model in ``configure_model`` (for real on rank 0 only, with ``init="rank0"``);
    :meth:`Par3DEngine.parallelize <lightning_par3d.engine.Par3DEngine.parallelize>` then applies the layout. The
    configuration is validated when the strategy is created and again, with the world size, before any process is
    launched. Each hook is Lightning's, translated to the engine, grouped by job: what it shares with Fabric's
    strategy (:class:`~lightning_par3d.integrations.lightning_shared.LightningFrontEnd`), the step hooks
    (:class:`~lightning_par3d.integrations.lightning_pipeline.PipelinedTrainingSteps`), the checkpoint hooks
    (:class:`~lightning_par3d.integrations.lightning_checkpoints.TrainerCheckpointHooks`), the precision plugin
    (:class:`~lightning_par3d.integrations.lightning_precision.UsesPar3DPrecision`) and, below, the rest.
    """

    strategy_name = "par3d"
    launcher_class = Par3DLauncher  # Lightning's, putting back what a killed save left aside first

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
        self._held_grads = HeldGradients()  # see training_step
        self._elastic = ElasticRun(self.engine)
        self._plan_copy: Any = None  # layout="auto": the module before configure_model, on rank 0
        self.num_nodes = 1

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.device_mesh

    @property
    def is_distributed(self) -> bool:
        return True

    @override
    def setup_environment(self) -> None:
        self.resolve_world()  # raises before the process group exists if the sizes do not fit
        self._elastic.check_launch()
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
        shared.check_checkpoint_directories(self.engine, trainer)
        if self.engine.awaits_layout:  # Lightning's own resolution of the training data
            loader = trainer.fit_loop._data_source.dataloader()
            sample = measure_with(self.engine.config, self._plan_copy, loader, None, trainer.default_root_dir)
            self.plan_layout(self._plan_copy, loader, "the training loader", trainer.accumulate_grad_batches, sample)
            module._device_mesh = self.device_mesh
            assert self.engine.batch_split is not None
            trainer.accumulate_grad_batches = self.engine.batch_split.accumulate  # the global batch kept
        self.model = self.engine.parallelize(module)
        shared.point_at_device(module, self.root_device)
        spec = self.engine.pipeline_spec
        if spec is not None and spec.loss is not None:  # what the loss logs on the last stage, every stage logs
            install_loss(module, spec.loss, LogRelay(self.engine, module))
        if self.engine.placement.relayout_note:
            rank_zero_info(f"par3d {self.engine.placement.relayout_note}")
        rank_zero_info(self.engine.describe())
        self.engine.accumulate_grad_batches = trainer.accumulate_grad_batches
        check_epochs(self.engine, trainer)
        use_par3d_summary(trainer)  # the whole model's counts at any layout, no FLOPs of 0
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

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
    def process_dataloader(self, dataloader: object) -> object:
        """The training dataloader: at the per-rank batch size ``layout="auto"`` chose (:func:`~lightning_par3d.
        integrations.lightning_data.rebatched`), an elastic run's through an ``ElasticSampler``
        (:mod:`~lightning_par3d.integrations.lightning_elastic`), one accumulation window ahead
        (:func:`~lightning_par3d.engine.tokens.read_ahead`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        training = trainer is not None and trainer.state.stage == RunningStage.TRAINING
        loader = self._elastic.process_dataloader(
            rebatched(self.engine, dataloader) if training else dataloader, trainer
        )
        if trainer is None or not training:
            return loader
        return read_ahead(self.engine.token_mean, loader, lambda: trainer.num_training_batches)

    # ---------------------------------------------------------------- collectives
    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """What ``self.log(..., sync_dist=True)`` calls: over the data-parallel ranks only (tp peers hold the same
        value; every pipeline rank logs the last stage's), unless a ``group`` is given."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            return sync_over(tensor, group, reduce_op=reduce_op)
        return self.engine.reduce(tensor, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agreed over every rank (ModelCheckpoint, EarlyStopping)."""
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = sync_over(flag, None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    # ---------------------------------------------------------------- the end
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


register_trainer_strategy(Par3DStrategy)  # "par3d" in Lightning's registry, whoever imported this module
