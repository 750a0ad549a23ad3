"""``Par3DAccelerator``: the par3d layouts from an ordinary Accelerate training loop, as thin glue over
:class:`~lightning_par3d.engine.Par3DEngine`.

A script changes one line::

    accelerator = Par3DAccelerator(par3d=Par3DConfig(pp=2, tp=2), mixed_precision="bf16", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = accelerator.train_step(model, x, y, loss_fn)   # forward + backward at any layout, pipeline included
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the norm over pp, tp and dp
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                                # sharded (DCP), loadable at another layout

Without pipelining ``loss = loss_fn(model(x), y); accelerator.backward(loss)`` works unchanged.

Accelerate has no registry for third-party strategies, so this subclasses ``Accelerator`` (as its own Megatron-LM
integration branches inside it) and keeps Accelerate's process group, distributed type, gradient-accumulation
bookkeeping, RNG and scheduler checkpoints, ``print`` and trackers, while the model, the optimizer, the data split,
the step, clipping, gathering and the model's checkpoints go through the engine. Accelerate's own
``ParallelismConfig``, FSDP, DeepSpeed and Megatron-LM plugins are refused beside ``par3d=`` (a
``ParallelismConfig`` can be converted: :meth:`Par3DConfig.from_accelerate
<lightning_par3d.config.Par3DConfig.from_accelerate>`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import InitProcessGroupKwargs, convert_outputs_to_fp32, recursively_apply
from accelerate.utils.modeling import get_mixed_precision_context_manager
from torch import nn
from torch.optim import Optimizer

from lightning_par3d.config import Par3DConfig
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.parallel import groups
from lightning_par3d.parallel.gradients import clip_grads_
from lightning_par3d.parallel.precision import GlobalGradScaler
from lightning_par3d.pipeline.trunk import PipelineHost
from lightning_par3d.zero.optimizer import optimizer_grads

PRECISIONS = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
"""Accelerate's ``mixed_precision`` → par3d's precision."""
_FOREIGN_PLUGINS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "parallelism_config")
_FOREIGN_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")

LossFn = Callable[[Any, Any], torch.Tensor]


class Par3DAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` that trains at a par3d layout (see the module docstring).

    Args:
        par3d: the layout and its settings; default: fully sharded data parallel over every process.
        parallelism_config: an Accelerate ``ParallelismConfig`` to convert instead of ``par3d``.
        **kwargs: Accelerate's own arguments (``mixed_precision``, ``gradient_accumulation_steps``, ``log_with``, …).
            ``cpu`` defaults to True on a machine without CUDA.
    """

    def __init__(
        self, *args: Any, par3d: Par3DConfig | None = None, parallelism_config: Any = None, **kwargs: Any
    ) -> None:
        foreign = [name for name in _FOREIGN_PLUGINS if kwargs.get(name) is not None]
        foreign += [name for name in _FOREIGN_ENV if os.environ.get(name, "").lower() in ("1", "true")]
        if foreign:
            raise ValueError(
                f"Par3DAccelerator applies par3d's own parallelism; it cannot run together with {', '.join(foreign)}. "
                "Remove them (a ParallelismConfig converts with Par3DConfig.from_accelerate(...) or "
                "Par3DAccelerator(parallelism_config=...))."
            )
        if par3d is not None and parallelism_config is not None:
            raise TypeError("Pass either par3d= or parallelism_config= to Par3DAccelerator, not both.")
        config = Par3DConfig.from_accelerate(parallelism_config) if parallelism_config is not None else par3d
        config = config or Par3DConfig()
        mixed = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed = str(mixed.value if hasattr(mixed, "value") else mixed)
        if mixed not in PRECISIONS:
            raise ValueError(
                f"mixed_precision={mixed!r}: Par3DAccelerator supports {', '.join(map(repr, PRECISIONS))}."
            )
        cpu = kwargs.setdefault("cpu", not torch.cuda.is_available())
        if mixed == "fp16" and cpu:
            raise ValueError(
                "mixed_precision='fp16' needs CUDA (Accelerate applies neither autocast nor loss scaling on CPU). "
                "Use mixed_precision='bf16' on CPU."
            )
        self.engine = Par3DEngine(config, precision=PRECISIONS[mixed])
        world = _world_size()
        self.engine.resolve(world, "cpu" if cpu else "cuda")  # every check that can fail, before any process group
        handlers = list(kwargs.pop("kwargs_handlers", None) or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(timeout=groups.join_timeout(config.timeout_s)))
        super().__init__(*args, kwargs_handlers=handlers, **kwargs)
        self._prepared: list[nn.Module] = []
        self._prepared_in_this_call: list[nn.Module] = []
        self.engine.setup(self.device)
        self.engine.accumulate = self.gradient_accumulation_steps
        if mixed == "fp16":  # one overflow decision for every shard of every rank
            self.scaler = GlobalGradScaler(self.device.type)

    # ---------------------------------------------------------------- layout
    @property
    def dp_size(self) -> int:
        """Data-parallel processes: how many different slices of each global batch are read."""
        return self.engine.dp_size

    @property
    def dp_rank(self) -> int:
        """Which slice this process reads (tensor-parallel and pipeline peers read the same)."""
        return self.engine.dp_rank

    @contextmanager
    def init_empty_weights(self) -> Generator[None, None, None]:
        """Where to build the model: for real on process 0 and without memory elsewhere (parameters on the meta
        device), so that ``prepare`` gives every process the single-process weights without a full copy on each."""
        with self.engine.init_context():
            yield

    # ---------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``: models, then optimizers (pointed at the prepared parameters), schedulers and
        dataloaders, in one call or several."""
        self._prepared_in_this_call = []
        try:
            return super().prepare(*args, device_placement=device_placement)
        finally:
            self._prepared_in_this_call = []

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
            target._original_forward = target.forward  # type: ignore[assignment]
            target.forward = convert_outputs_to_fp32(autocast(target.forward))
        trained._is_accelerate_prepared = True  # type: ignore[assignment]
        self._models.append(trained)
        return trained

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> Optimizer:
        """``optimizer`` over the parallelized parameters (one built over the model before ``prepare`` is pointed
        at them by name), wrapped in par3d's ZeRO-1/2 optimizer where configured, and in Accelerate's."""
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return optimizer
        if not self._models:
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
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> Any:
        """One scheduler step per optimizer step (Accelerate's default steps it once per process)."""
        if getattr(scheduler, "_is_accelerate_prepared", False):
            return scheduler
        optimizers: Any = self._optimizers
        for optimizer in self._optimizers:
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
        self._dataloaders.append(prepared)
        return prepared

    # ---------------------------------------------------------------- steps
    def train_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of one batch at any layout (through the pipeline schedule under pp); returns the
        batch's mean loss, the same on every process of a data-parallel rank. ``inputs`` is a tensor, a tuple of
        arguments or a dict of keyword arguments; ``loss_fn(outputs, targets)`` gives the loss (under pp it runs
        on the last stage, inside the schedule)."""
        if not callable(loss_fn):
            raise TypeError(
                "train_step needs the loss function, loss_fn(outputs, targets) -> loss: under pp it runs on the last "
                "stage, inside the pipeline schedule."
            )
        with self.autocast():
            return self.engine.train_step(model, inputs, targets, loss_fn, backward=self._backward)

    def eval_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of one batch, forward only, at any layout."""
        with self.autocast():
            return self.engine.eval_step(model, inputs, targets, loss_fn)

    def predict_step(self, model: nn.Module, inputs: Any) -> Any:
        """The model's outputs for one batch: under pp on the processes holding the last stage (None on the
        others, whose :meth:`gather_for_metrics` takes the last stage's)."""
        from lightning_par3d.engine import _pending

        with torch.no_grad(), self.autocast():
            if self.engine.layout.pp == 1:
                return model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            return self.engine.predict(_pending(inputs))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.engine.layout.pp > 1:
            raise RuntimeError(
                "Under pp > 1 the backward pass runs inside the pipeline schedule: replace `loss = loss_fn(model(x), "
                "y); accelerator.backward(loss)` by `loss = accelerator.train_step(model, x, y, loss_fn)`."
            )
        self._backward(loss, **kwargs)

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Generator[None, None, None]:
        """Gradients stay local (the non-final batches of ``accumulate``): DDP's, FSDP2's or ZeRO-1's sync off."""
        with self.engine.no_sync():
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        """Clips by the norm over every tp, dp and pp shard (the single-process norm); returns the norm. On the
        non-final batches of ``accumulate`` the gradients are partial, so nothing is clipped and None returned."""
        if not self.sync_gradients:
            return None
        self.unscale_gradients()
        params = list(parameters)
        zero = self.engine.zero_optimizers
        grads = (
            optimizer_grads(zero[0]) if zero and zero[0].stage == 2 else [p.grad for p in params if p.grad is not None]
        )
        pp_group = self.engine.mesh["pp"].get_group() if self.engine.layout.pp > 1 else None
        return clip_grads_(grads, float(max_norm), float(norm_type), pp_group)

    # ---------------------------------------------------------------- gathering
    def gather(self, tensor: Any) -> Any:
        """``tensor`` from every data-parallel process, concatenated on the first dimension, on every process: the
        data-parallel group only (tensor-parallel peers hold the same samples), and under pp the last stage's
        values (the other stages may pass anything, e.g. None)."""
        if self.engine.layout.pp == 1:
            return self._gather_data_parallel(tensor)
        runner = self.engine.pipeline
        assert runner is not None
        local = _to_cpu(self._gather_data_parallel(tensor)) if runner.holds_last_stage else None
        return recursively_apply(lambda t: t.to(self.device), runner.broadcast_object_from_last_stage(local))

    def _gather_data_parallel(self, tensor: Any) -> Any:
        import torch.distributed as dist

        def gathered(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(1) if t.dim() == 0 else t
            parts = [torch.empty_like(t) for _ in range(self.engine.dp_size)]
            dist.all_gather(parts, t.contiguous(), group=self.engine.dp_group())
            return torch.cat(parts)

        return recursively_apply(gathered, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's ``gather_for_metrics`` over the data-parallel processes (every sample once: the padding
        that evens out the last batch is dropped). Under pp the last stage's outputs are taken, whatever the other
        stages pass (None, typically)."""
        if self.engine.layout.pp == 1:
            return super().gather_for_metrics(input_data, use_gather_object)
        runner = self.engine.pipeline
        assert runner is not None
        if runner.holds_last_stage and (use_gather_object or not _all_tensors(input_data)):
            import torch.distributed as dist

            parts: list[Any] = [None] * self.engine.dp_size
            dist.all_gather_object(parts, input_data, group=self.engine.dp_group())
            local: Any = ("objects", [item for part in parts for item in part])
        else:
            local = ("tensors", _to_cpu(self._gather_data_parallel(input_data))) if runner.holds_last_stage else None
        kind, data = runner.broadcast_object_from_last_stage(local)
        if kind == "tensors":
            data = recursively_apply(lambda t: t.to(self.device), data)
        remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else 0
        if remainder > 0:
            return data[:remainder] if kind == "objects" else recursively_apply(lambda t: t[:remainder], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduces over the data-parallel processes (``"sum"``, ``"mean"``, ``"max"``)."""
        return recursively_apply(lambda t: self.engine.reduce(t * scale, reduction), tensor)

    # ---------------------------------------------------------------- weights and checkpoints
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The model the script built (out of DDP or the pipeline host)."""
        module = self.engine.module
        if isinstance(module, PipelineHost):
            module = module.trunk
        if not keep_fp32_wrapper and hasattr(module, "_original_forward"):
            module.forward = module._original_forward  # type: ignore[assignment]
        return module

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """The whole model's weights, unsharded and under their original names, on process 0 (None elsewhere)."""
        return self.engine.full_state_dict()

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes the prepared Hugging Face transformers model as a ``save_pretrained`` directory from any layout
        (weights gathered on process 0, which writes them). Use it instead of ``unwrap_model(model).save_pretrained``:
        under pipeline parallelism no process holds the whole model. Every process must call it."""
        return self.engine.save_pretrained(directory)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's state (schedulers, RNG, samplers, registered objects) as Accelerate saves it, and the model
        and optimizers as one sharded DCP checkpoint (``output_dir/par3d``), loadable at any layout."""
        models, optimizers = self._models, self._optimizers  # type: ignore[has-type]
        self._models, self._optimizers = [], []
        try:
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        tensors = {"state_dict": self.engine.model_state()}
        for i, optimizer in enumerate(optimizers):
            tensors[f"optimizer_{i}"] = self.engine.optimizer_state(optimizer.optimizer)
        self.engine.save(Path(location) / "par3d", tensors, {"step": self.step})  # type: ignore[has-type]
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """The counterpart of :meth:`save_state`; the checkpoint may come from another layout."""
        models, optimizers = self._models, self._optimizers
        self._models, self._optimizers = [], []
        try:
            super().load_state(input_dir, load_kwargs, **kwargs)
        finally:
            self._models, self._optimizers = models, optimizers
        assert input_dir is not None
        targets = {f"optimizer_{i}": optimizer.optimizer for i, optimizer in enumerate(optimizers)}
        metadata = self.engine.load(Path(input_dir) / "par3d", targets)
        self.step = int(metadata.get("step", self.step))  # type: ignore[arg-type, has-type]


def _all_tensors(value: Any) -> bool:
    try:
        recursively_apply(lambda x: x, value, error_on_other_type=True)
    except TypeError:
        return False
    return True


def _to_cpu(value: Any) -> Any:
    return recursively_apply(lambda t: t.detach().cpu(), value) if value is not None else None


def _world_size() -> int:
    """The job's world size: the process group's if one exists (Lightning drops ``WORLD_SIZE`` from the environment
    when its Trainer tears down), else the launcher's ``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
