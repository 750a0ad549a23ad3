"""``Trainer(strategy="par3d")``: thin Lightning glue over :class:`~lightning_par3d.engine.Par3DEngine`."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.checkpoint import dcp as ckpt
from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.integrations import lightning_shared as shared
from lightning_par3d.integrations.lightning_logging import LogRelay
from lightning_par3d.integrations.lightning_precision import Par3DPrecision, as_par3d_precision
from lightning_par3d.parallel.mesh import Par3DMesh
from lightning_par3d.parallel.precision import precision_name
from lightning_par3d.pipeline.runner import PendingPipelineOutput
from lightning_par3d.pipeline.trunk import install_loss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _op_name(reduce_op: ReduceOp | str | None) -> str:
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        return {"avg": "mean"}.get(name, name)
    names = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.AVG: "mean"}
    return names[reduce_op]  # type: ignore[index]


class Par3DStrategy(ParallelStrategy):
    """Trains an unchanged LightningModule at any mix of data, tensor and pipeline parallelism.

    Give the settings either as a :class:`~lightning_par3d.config.Par3DConfig` or as its fields::

        Trainer(devices=4, strategy=Par3DStrategy(dp_shard=2, tp=2))

    The LightningModule builds its model in ``configure_model``; par3d runs that hook on the meta device (for real on
    rank 0 only, with the default ``init="rank0"``), then :meth:`Par3DEngine.parallelize
    <lightning_par3d.engine.Par3DEngine.parallelize>` applies the layout. The configuration is validated when the
    strategy is created and again, with the world size, before any process is launched or process group created.
    ``fit`` then ``validate``/``test``/``predict`` (or a second ``fit``) reuse the parallelized module.
    """

    strategy_name = "par3d"

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
        **settings: Any,
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
        self._held_grads: dict[Tensor, Tensor] = {}
        self._failed = False
        self.num_nodes = 1

    # ---------------------------------------------------------------- layout
    @property
    def config(self) -> Par3DConfig:
        return self.engine.config

    @property
    def loads_pretrained(self) -> bool:
        """Whether par3d reads the model's weights from a ``save_pretrained`` directory (``init="pretrained"``):
        ``configure_model`` then builds the transformers model from its config (``from_config``), not with
        ``from_pretrained``."""
        return self.config.init == "pretrained"

    @property
    def layout(self) -> Layout:
        """The resolved layout, known once the Trainer has set devices and nodes."""
        if self.engine._layout is None:
            device_type = self.parallel_devices[0].type if self.parallel_devices else "cpu"
            self.engine.resolve(self.num_nodes * self.num_processes, device_type)
        return self.engine.layout

    @property
    def mesh(self) -> Par3DMesh:
        return self.engine.mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is split over data-parallel ranks only: tensor-parallel and pipeline peers read the same batches."""
        return self.engine.sampler_kwargs()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

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

    # ---------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        _ = self.layout  # validate against the world size, precision and devices before any process is launched
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        _ = self.layout  # raises before the process group exists if the sizes do not fit
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = shared.init_distributed(
            self.cluster_environment, self.root_device, self._process_group_backend, self.config.timeout_s
        )
        self._process_group_backend = backend
        self.engine.setup(self.root_device, backend)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh

    def set_world_ranks(self) -> None:
        shared.set_world_ranks(
            self.cluster_environment, self.node_rank, self.local_rank, self.num_processes, self.num_nodes
        )

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
        self.model = self.engine.parallelize(module)
        shared.point_at_device(module, self.root_device)
        spec = self.engine.pipeline_spec
        if spec is not None:  # what the loss logs on the last stage, every stage logs
            install_loss(module, spec.loss, LogRelay(self.engine, module))
        rank_zero_info(self.engine.describe())
        self.engine.accumulate = trainer.accumulate_grad_batches
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
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp the schedule runs forward and backward inside the step. The gradients it made are held aside
        until Lightning's backward call: Lightning clears gradients between the step and its backward, which here
        would discard them."""
        assert self.lightning_module is not None
        self.engine.note_step(self.lightning_module.global_step)
        if self.engine.pipeline is None:
            return super().training_step(*args, **kwargs)
        self._restore_grads()
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.engine.clear_grads_first = batch_idx % self.engine.accumulate == 0
        output = super().training_step(*args, **kwargs)
        self._held_grads = {p: p.grad for p in self.lightning_module.parameters() if p.grad is not None}
        for param in self._held_grads:
            param.grad = None
        return output

    def _restore_grads(self) -> None:
        for param, grad in self._held_grads.items():
            param.grad = grad
        self._held_grads = {}

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Under pp the schedule already ran the backward pass inside the step; the hooks around backward still
        run, and the gradients come back, but the backward itself does not run twice."""
        if self.engine.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._restore_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._restore_grads()  # a step whose training_step returned no loss never reached backward
        return output

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1 the trunk's outputs exist on the last stage only: ranks holding it return them, the
        others return None."""
        out = super().predict_step(*args, **kwargs)
        if self.engine.pipeline is not None and isinstance(out, PendingPipelineOutput):
            return self.engine.predict(out)
        return out

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

    # ---------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        shared.barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return shared.broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """What ``self.log(..., sync_dist=True)`` calls: reduces over the data-parallel ranks only (tensor-parallel
        peers hold the same value; every pipeline rank logs the last stage's), unless a ``group`` is given. Ranks at
        different pipeline stages are in different data-parallel groups, so their logged keys never pair."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return self.engine.reduce(tensor, _op_name(reduce_op))

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agreed over every rank (ModelCheckpoint, EarlyStopping)."""
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A rank that raises ends the whole job promptly: it says which rank failed first and why (and, for a
        collective that timed out, which rank fell behind), and kills the local ranks it launched."""
        self._failed = True
        if shared.is_failure(exception) and not isinstance(exception, KeyboardInterrupt):
            shared.end_job(self._launcher, self.engine.describe_failure(exception))

    @override
    def teardown(self) -> None:
        self._restore_grads()
        self.engine.teardown()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the model (DTensors); saved with DCP, never gathered."""
        return self.engine.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.engine.optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` already restored the shards in place."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` already restored the shards in place."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("par3d saves with torch.distributed.checkpoint and takes no `storage_options`.")
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        self.engine.save(self.broadcast(str(filepath)), tensors, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        path = self.broadcast(str(checkpoint_path))
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)}
        strict = self.lightning_module.strict_loading
        return self.engine.load(path, optimizers, strict=strict, weights_only=weights_only)

    def save_pretrained(self, directory: _PATH) -> Path:
        """Writes the Hugging Face transformers model inside the LightningModule as a ``save_pretrained`` directory
        (see :meth:`Par3DEngine.save_pretrained`); every rank must call it, as in ``on_train_end``. The
        :class:`~lightning_par3d.callbacks.SavePretrained` callback does it for you."""
        return self.engine.save_pretrained(self.broadcast(str(directory)))

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            ckpt.remove_checkpoint(Path(filepath))
