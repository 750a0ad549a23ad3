"""``Trainer(strategy="par3d")``: thin Lightning glue over :func:`~lightning_par3d.parallelize.parallelize`."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d import checkpoint as ckpt
from lightning_par3d.compression import check_compression_device
from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.data_parallel import no_gradient_sync
from lightning_par3d.distributed import build_mesh, init_distributed
from lightning_par3d.materialize import build_context
from lightning_par3d.mesh import Par3DMesh
from lightning_par3d.parallelize import parallelize
from lightning_par3d.pipeline import PendingPipelineOutput
from lightning_par3d.precision import Par3DPrecision, as_par3d_precision, check_precision, precision_name
from lightning_par3d.zero import wrap_optimizers, zero_optimizers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class Par3DStrategy(ParallelStrategy):
    """Trains an unchanged LightningModule at any mix of sharded/replicated data parallel and tensor parallel.

    Give the settings either as a :class:`~lightning_par3d.config.Par3DConfig` or as its fields::

        Trainer(devices=4, strategy=Par3DStrategy(dp_shard=2, tp=2))

    The LightningModule builds its model in ``configure_model``; par3d runs that hook on the meta device (for real on
    rank 0 only, with the default ``init="rank0"``), then applies the tensor-parallel plan, FSDP2 per block and at
    the root, and materializes each rank's shards. The configuration is validated when the strategy is created and
    again, with the world size, before any process is launched or process group created.
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
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if config is not None and settings:
            raise TypeError(
                f"Pass either a Par3DConfig or its fields to {type(self).__name__}, not both (got config and "
                f"{', '.join(sorted(settings))})."
            )
        self.config = config if config is not None else Par3DConfig(**settings)
        resolve_layout(self.config)  # world-independent checks, at construction time
        self._process_group_backend = process_group_backend
        self._layout: Layout | None = None
        self._mesh: Par3DMesh | None = None
        self.num_nodes = 1

    # ---------------------------------------------------------------- layout
    @property
    def layout(self) -> Layout:
        """The resolved mesh sizes, known once the Trainer has set devices and nodes."""
        if self._layout is None:
            self._layout = resolve_layout(self.config, self.num_nodes * self.num_processes)
        assert self._layout is not None
        return self._layout

    @property
    def mesh(self) -> Par3DMesh:
        if self._mesh is None:
            raise RuntimeError("Accessing the par3d mesh before processes have initialized is not allowed.")
        return self._mesh

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
        """Data is split over data-parallel ranks only: tensor-parallel peers read the same batches."""
        return {"num_replicas": self.mesh.layout.dp, "rank": self.mesh.dp_rank(self.global_rank)}

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
        return self._precision_plugin if self._precision_plugin is not None else Par3DPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        """Lightning's plugin for ``precision=`` becomes par3d's counterpart (see :mod:`lightning_par3d.precision`);
        an unsupported precision raises here, before any process is launched."""
        self._precision_plugin = as_par3d_precision(precision_plugin) if precision_plugin is not None else None

    @property
    def precision(self) -> str:
        """Lightning's ``precision=`` value in use (``"32-true"``, ``"bf16-mixed"``, …)."""
        return precision_name(self.precision_plugin)

    # ---------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        # Validate against the world size, the precision and the devices before any process is launched.
        check_precision(self.precision, self.layout.zero)
        check_compression_device(self.config.grad_compression, self.root_device.type)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        layout = self.layout  # raises before the process group exists if the sizes do not fit
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = init_distributed(
            self.cluster_environment, self.root_device, self._process_group_backend, self.config.timeout_s
        )
        self._process_group_backend = backend
        self._mesh = build_mesh(layout, self.root_device, backend, self.config.timeout_s)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- model
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``configure_model`` builds the model: see :func:`~lightning_par3d.materialize.build_context`."""
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        with build_context(self.config.init, self.global_rank), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        # No convert_module: under "bf16-true" the model was built in bf16 (tensor_init_context), and FSDP2 modules
        # must not be cast after sharding.
        self.model, report = parallelize(self.model, self.mesh, self.config, self.root_device, self.precision)
        rank_zero_info(f"par3d: {self.layout} on {self.world_size} ranks; {report}.")
        runner = getattr(self.lightning_module, "_par3d_pipeline", None)
        if self.layout.pp > 1:
            self.precision_plugin.pp_group = self.mesh["pp"].get_group()  # type: ignore[attr-defined]
            if runner is not None:
                runner.accumulate = trainer.accumulate_grad_batches
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            if runner is not None:
                runner.zero = zero_optimizers(self.optimizers)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The LightningModule's optimizers; under zero_stage 1 or 2 each is wrapped in a
        :class:`~lightning_par3d.zero.ZeroOptimizer` (its schedulers follow the wrapper)."""
        _close_zero(self.optimizers)
        super().setup_optimizers(trainer)
        if self.layout.zero in (1, 2):
            schedulers = [config.scheduler for config in self.lr_scheduler_configs]
            self.optimizers = wrap_optimizers(self.optimizers, schedulers, self.layout.zero, self.mesh)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        runner = getattr(self.lightning_module, "_par3d_pipeline", None)
        if runner is not None:
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            runner.zero_grad_first = batch_idx % runner.accumulate == 0
        return super().training_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp > 1 the trunk's outputs exist on the last stage only: ranks holding it return them, the
        others return None."""
        out = super().predict_step(*args, **kwargs)
        runner = getattr(self.lightning_module, "_par3d_pipeline", None)
        if runner is not None and isinstance(out, PendingPipelineOutput):
            return runner.predict(out, self.root_device)
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Under pp > 1 the pipeline schedule already ran the backward pass inside the step; the hooks around
        backward still run, the backward itself does not run twice."""
        if self.config.pp == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def model_to_device(self) -> None:  # parallelize() materialized every shard on the device already
        assert self.model is not None
        if not self.config.offload:  # offloaded shards stay in CPU memory
            self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skips the gradient reduction on the non-final batches of ``accumulate_grad_batches``."""
        assert self.model is not None
        with ExitStack() as stack:
            stack.enter_context(no_gradient_sync(self.model))
            for zero in zero_optimizers(self.optimizers):
                stack.enter_context(zero.no_sync())
            yield

    # ---------------------------------------------------------------- collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduces over all ranks. Tensor-parallel peers hold equal values, so the mean is the data-parallel mean."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        _close_zero(self.optimizers)
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards of the model (DTensors); saved with DCP, never gathered."""
        assert self.model is not None
        return ckpt.model_state(self.model)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return ckpt.optimizer_state(self.model, optimizer)

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
        path = Path(self.broadcast(filepath))
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        ckpt.save_sharded(path, tensors, checkpoint, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.model is not None
        assert self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        return ckpt.load_sharded(path, self.model, self.optimizers, strict=self.lightning_module.strict_loading)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _close_zero(optimizers: Iterable[Any]) -> None:
    """Removes the gradient hooks of the ZeRO wrappers among ``optimizers`` (before new ones replace them)."""
    for zero in zero_optimizers(optimizers):
        zero.close()
