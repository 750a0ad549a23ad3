"""``Fabric(strategy="par3d")``: the same parallelization for Fabric scripts.

Build the model under ``fabric.init_module()`` (real on rank 0, meta elsewhere with the default
``init="rank0"``), then ``model = fabric.setup_module(model)`` and create the optimizer from the parallelized
parameters::

    with fabric.init_module(empty_init=True):
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d import checkpoint as ckpt
from lightning_par3d.compression import check_compression_device
from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.data_parallel import no_gradient_sync
from lightning_par3d.distributed import build_mesh, init_distributed
from lightning_par3d.gradients import clip_optimizer_grads
from lightning_par3d.materialize import build_context
from lightning_par3d.mesh import Par3DMesh
from lightning_par3d.parallelize import parallelize
from lightning_par3d.pipeline import PendingPipelineOutput, PipelineHost, PipelineRunner
from lightning_par3d.precision import check_precision, precision_name
from lightning_par3d.zero import ZeroOptimizer


class Par3DFabricStrategy(ParallelStrategy):
    """The Fabric counterpart of :class:`~lightning_par3d.strategy.Par3DStrategy`; same settings, same order of
    parallelisms, same checkpoint layout."""

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
        **settings: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        if config is not None and settings:
            raise TypeError("Pass either a Par3DConfig or its fields to Par3DFabricStrategy, not both.")
        self.config = config if config is not None else Par3DConfig(**settings)
        resolve_layout(self.config)
        self._process_group_backend = process_group_backend
        self._layout: Layout | None = None
        self._mesh: Par3DMesh | None = None
        self._num_nodes = 1
        self._backward_sync_control = _Par3DBackwardSyncControl(self)
        self._zero: list[ZeroOptimizer] = []

    @property
    def layout(self) -> Layout:
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
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.mesh.layout.dp, "rank": self.mesh.dp_rank(self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        # Validate against the world size, the precision and the devices before any process is launched.
        check_precision(precision_name(self.precision), self.layout.zero)
        check_compression_device(self.config.grad_compression, self.root_device.type)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        layout = self.layout
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        assert self.cluster_environment is not None
        backend = init_distributed(
            self.cluster_environment, self.root_device, self._process_group_backend, self.config.timeout_s
        )
        self._process_group_backend = backend
        self._mesh = build_mesh(layout, self.root_device, backend, self.config.timeout_s)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Real tensors on rank 0 and meta elsewhere (``init="rank0"``), whatever ``empty_init`` says: the weights
        then equal a single process's, and only rank 0 ever holds a full copy."""
        stack = ExitStack()
        if self.config.seed is not None:
            torch.manual_seed(self.config.seed)
        stack.enter_context(build_context(self.config.init, self.global_rank))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def setup_module(self, module: Module) -> Module:
        """Parallelizes ``module``. Under pp > 1 it becomes the trunk of a :class:`PipelineHost` that
        :meth:`pipeline_step` runs through the schedule."""
        if self.layout.pp > 1:
            module = PipelineHost(module)
        module, report = parallelize(module, self.mesh, self.config, self.root_device, precision_name(self.precision))
        rank_zero_info(f"par3d: {self.layout} on {self.world_size} ranks; {report}.")
        self._module = module
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Under zero_stage 1 or 2, wraps ``optimizer`` in a :class:`~lightning_par3d.zero.ZeroOptimizer`."""
        if self.layout.zero not in (1, 2):
            return optimizer
        zero = ZeroOptimizer(optimizer, self.layout.zero, self.mesh)
        self._zero.append(zero)
        runner = getattr(getattr(self, "_module", None), "_par3d_pipeline", None)
        if runner is not None:
            runner.zero = self._zero
        return zero

    def pipeline_step(
        self, module: Module, inputs: Tensor, targets: Tensor, loss_fn: Callable[[Any, Any], Tensor], train: bool = True
    ) -> Tensor:
        """One batch through the model at any layout, returning its mean loss on every rank.

        ``train=True`` also runs the backward pass: under pp > 1 inside the pipeline schedule (microbatched,
        gradients accumulated into the parameters), otherwise as ``fabric.backward(loss)``. The script stays the
        same at every layout: ``loss = fabric.strategy.pipeline_step(model, x, y, loss_fn)``, then the optimizer
        step as usual.
        """
        if self.layout.pp == 1:
            with torch.set_grad_enabled(train):
                loss = loss_fn(module(inputs), targets)
            if train:
                self.backward(loss, module)
            return loss.detach()
        inner = getattr(module, "_forward_module", module)
        assert isinstance(inner, PipelineHost)
        runner: PipelineRunner = getattr(inner, "_par3d_pipeline")  # noqa: B009 (set outside the class)
        runner.loss_fn = loss_fn
        runner.zero_grad_first = False  # a Fabric script clears gradients itself, after optimizer.step()
        with torch.set_grad_enabled(train), self.precision.forward_context():
            return runner.run(PendingPipelineOutput((inputs,), {}), targets, train=train, device=self.root_device)

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
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
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
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clips by the norm over every shard: see :func:`~lightning_par3d.gradients.clip_grad_norm_`."""
        self.precision.unscale_gradients(optimizer)
        pp_group = self.mesh["pp"].get_group() if self.layout.pp > 1 else None
        norm = clip_optimizer_grads(optimizer, float(max_norm), float(norm_type), pp_group)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of the gradients is {norm.item()}; it must be finite to clip by it.")
        return norm

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Saves ``state`` as a sharded DCP directory: modules and optimizers by shard, the rest in ``meta.pt``."""
        if storage_options is not None or filter is not None:
            raise TypeError("par3d saves with torch.distributed.checkpoint and takes no `storage_options`/`filter`.")
        tensors = _sharded_states(state)
        metadata = {key: obj for key, obj in state.items() if key not in tensors}
        ckpt.save_sharded(Path(self.broadcast(path)), tensors, metadata, self.global_rank)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restores the modules and optimizers in ``state`` in place; returns the remaining saved entries."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        if not isinstance(state, dict):
            raise TypeError("par3d loads into a dict of objects, e.g. state={'model': model, 'optimizer': optimizer}.")
        path = Path(self.broadcast(path))
        if not ckpt.is_sharded_checkpoint(path):
            raise ValueError(f"{path} is not a par3d checkpoint directory (no torch.distributed.checkpoint metadata).")
        module = _single_module(state)
        tensors = _sharded_states(state, for_loading=True)
        dcp.load(tensors, checkpoint_id=path)
        for key, obj in state.items():
            if isinstance(obj, Module):
                set_model_state_dict(obj, tensors[key], options=StateDictOptions(strict=strict))
            elif isinstance(obj, Optimizer):
                ckpt.load_optimizer_state(module, obj, tensors[key])
        metadata: dict[str, Any] = torch.load(path / ckpt.METADATA_FILENAME, weights_only=False)
        for key in list(metadata):
            if key in state and not isinstance(state[key], (Module, Optimizer)):
                state[key] = metadata.pop(key)
        return metadata


def _sharded_states(state: dict[str, Any], for_loading: bool = False) -> dict[str, Any]:
    """The sharded state dicts of the model and optimizers in ``state``, by key (DCP loads into them in place)."""
    module = _single_module(state)
    tensors: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, Module):
            tensors[key] = ckpt.model_state(obj)
        elif isinstance(obj, Optimizer):
            tensors[key] = ckpt.optimizer_state(module, obj, for_loading=for_loading)
    return tensors


def _single_module(state: dict[str, Any]) -> Module:
    modules = [obj for obj in state.values() if isinstance(obj, Module)]
    if len(modules) != 1:
        raise ValueError(
            f"par3d checkpoints hold exactly one model; the state has {len(modules)}. Save each model separately."
        )
    return modules[0]


class _Par3DBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: DDP's or FSDP2's gradient sync off, and ZeRO-1's all-reduce."""

    def __init__(self, strategy: Par3DFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _no_sync(module, enabled, self.strategy._zero)


@contextmanager
def _no_sync(module: Module, enabled: bool, zero: list[ZeroOptimizer]) -> Generator[None, None, None]:
    if not enabled:
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(no_gradient_sync(getattr(module, "_forward_module", module)))
        for optimizer in zero:
            stack.enter_context(optimizer.no_sync())
        yield
