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
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, recursively_apply
from torch import nn

from lightning_par3d.config import (
    Par3DConfig,
    changed_settings,
    config_from,
    explicit_settings,
    field_keywords,
    split_settings,
)
from lightning_par3d.distributed import groups
from lightning_par3d.distributed.gather import map_tensors, only_tensors
from lightning_par3d.distributed.threads import local_processes_from_env, set_threads_per_rank
from lightning_par3d.engine import Par3DEngine
from lightning_par3d.engine.elastic import check_front_end
from lightning_par3d.integrations.accelerate_prepare import PreparedForPar3D
from lightning_par3d.integrations.accelerate_state import Par3DStateCheckpoints
from lightning_par3d.parallel.precision import GlobalGradScaler

PRECISIONS = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
"""Accelerate's ``mixed_precision`` → par3d's precision."""
_FOREIGN_PLUGINS = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "parallelism_config")
_FOREIGN_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM")

LossFn = Callable[[Any, Any], torch.Tensor]


class Par3DAccelerator(PreparedForPar3D, Par3DStateCheckpoints, Accelerator):
    """An ``accelerate.Accelerator`` that trains at a par3d layout (see the module docstring).

    Args:
        par3d: the layout and its settings; default: fully sharded data parallel over every process.
        parallelism_config: an Accelerate ``ParallelismConfig`` to convert instead of ``par3d``: its
            ``dp_replicate_size``, ``dp_shard_size`` and ``tp_size`` give ``dp_replicate``, ``dp_shard`` and ``tp``.
        dp_replicate, dp_shard, …, timeout_s: :class:`~lightning_par3d.config.Par3DConfig`'s fields as typed
            keywords with its defaults (a list or dict field's None means its empty default), instead of ``par3d``,
            or beside ``parallelism_config`` for the fields it does not give. None of them shares a name with
            ``Accelerator``'s own arguments (a test keeps it so), so each keyword goes to exactly one of the two.
        **kwargs: Accelerate's own arguments (``mixed_precision``, ``gradient_accumulation_steps``, ``log_with``, …).
            ``cpu`` defaults to True on a machine without CUDA.
    """

    @field_keywords
    def __init__(
        self,
        *args: Any,
        par3d: Par3DConfig | None = None,
        parallelism_config: Any = None,
        **kwargs: Any,
    ) -> None:
        settings, kwargs = split_settings(kwargs)
        config = _config(par3d, parallelism_config, settings)
        check_front_end("Par3DAccelerator", config)
        mixed, cpu = _checked_accelerate_arguments(kwargs)
        self.engine = Par3DEngine(config, precision=PRECISIONS[mixed])
        world = _world_size()
        self.engine.resolve(world, "cpu" if cpu else "cuda")  # every check that can fail, before any process group
        set_threads_per_rank(local_processes_from_env())  # par3d's rule, before Accelerate applies its own
        handlers = list(kwargs.pop("kwargs_handlers", None) or [])
        if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
            handlers.append(InitProcessGroupKwargs(timeout=groups.join_timeout(config.timeout_s)))
        super().__init__(*args, kwargs_handlers=handlers, **kwargs)
        self._prepared: list[nn.Module] = []
        self._prepared_in_this_call: list[nn.Module] = []
        self._batch_started = False
        self.engine.setup(self.device)
        self.engine.accumulate_grad_batches = self.gradient_accumulation_steps
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
        if not self._batch_started:  # accumulate() starts it, else here
            self.engine.start_batch()
        self._batch_started = False
        with self.autocast():
            return self.engine.train_step(model, inputs, targets, loss_fn, backward=self._backward)

    def eval_step(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of one batch, forward only, at any layout."""
        with self.autocast():
            return self.engine.eval_step(model, inputs, targets, loss_fn)

    def predict_step(self, model: nn.Module, inputs: Any) -> Any:
        """The model's outputs for one batch: under pp on the processes holding the last stage (None on the
        others, whose :meth:`gather_for_metrics` takes the last stage's)."""
        with self.autocast():
            return self.engine.predict_step(model, inputs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.engine.layout.pp > 1:
            raise RuntimeError(
                "Under pp > 1 the backward pass runs inside the pipeline schedule: replace `loss = loss_fn(model(x), "
                "y); accelerator.backward(loss)` by `loss = accelerator.train_step(model, x, y, loss_fn)`."
            )
        self._backward(loss, **kwargs)

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's backward (which divides by the accumulation); a token-mean share's ``1/w`` part of it."""
        self._batch_started = False
        super().backward(loss * self.engine.backward_factor(self.gradient_accumulation_steps), **kwargs)

    def _do_sync(self) -> None:
        """``accumulate()``: Accelerate's sync decision, and a training batch begins (its place in the accumulation
        window under ``loss_mean="tokens"``)."""
        super()._do_sync()
        self.engine.start_batch()
        self._batch_started = True

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
        return self.engine.clip_grad_norm_(parameters, float(max_norm), float(norm_type))

    # ---------------------------------------------------------------- gathering
    def gather(self, tensor: Any) -> Any:
        """``tensor`` from every data-parallel process, concatenated on the first dimension, on every process
        (:meth:`Par3DEngine.gather <lightning_par3d.engine.Par3DEngine.gather>`: tensor-parallel peers hold the same
        samples; under pp the last stage's values, whatever the other stages pass)."""
        return self.engine.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's ``gather_for_metrics`` over the data-parallel processes (every sample once: the padding
        that evens out the last batch is dropped). Under pp the last stage's outputs are taken, whatever the other
        stages pass (None, typically)."""
        if self.engine.layout.pp == 1:
            return super().gather_for_metrics(input_data, use_gather_object)
        last = self.engine.holds_last_stage
        as_objects = bool(
            self.engine.pipeline.broadcast_object_from_last_stage(  # type: ignore[union-attr]
                (use_gather_object or not only_tensors(input_data)) if last else None
            )
        )
        data = self.engine.gather(input_data, as_objects=as_objects)
        remainder = self.gradient_state.remainder if self.gradient_state.end_of_dataloader else 0
        if remainder > 0:
            return data[:remainder] if as_objects else map_tensors(lambda t: t[:remainder], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduces over the data-parallel processes (``"sum"``, ``"mean"``, ``"max"``)."""
        return recursively_apply(lambda t: self.engine.reduce(t * scale, reduction), tensor)


def _checked_accelerate_arguments(kwargs: dict[str, Any]) -> tuple[str, bool]:
    """Refuses Accelerate's own parallelism plugins and what par3d cannot run; returns ``mixed_precision`` and
    ``cpu`` (defaulting ``kwargs["cpu"]`` to True on a machine without CUDA)."""
    foreign = [name for name in _FOREIGN_PLUGINS if kwargs.get(name) is not None]
    foreign += [name for name in _FOREIGN_ENV if os.environ.get(name, "").lower() in ("1", "true")]
    if foreign:
        raise ValueError(
            f"Par3DAccelerator applies par3d's own parallelism; it cannot run together with {', '.join(foreign)}. "
            "Remove them (a ParallelismConfig converts with Par3DConfig.from_accelerate(...) or "
            "Par3DAccelerator(parallelism_config=...))."
        )
    mixed = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    mixed = str(mixed.value if hasattr(mixed, "value") else mixed)
    if mixed not in PRECISIONS:
        raise ValueError(f"mixed_precision={mixed!r}: Par3DAccelerator supports {', '.join(map(repr, PRECISIONS))}.")
    cpu = bool(kwargs.setdefault("cpu", not torch.cuda.is_available()))
    if mixed == "fp16" and cpu:
        raise ValueError(
            "mixed_precision='fp16' needs CUDA (Accelerate applies neither autocast nor loss scaling on CPU). "
            "Use mixed_precision='bf16' on CPU."
        )
    return mixed, cpu


def _to_cpu(value: Any) -> Any:
    return recursively_apply(lambda t: t.detach().cpu(), value) if value is not None else None


_FROM_PARALLELISM_CONFIG = ("dp_replicate", "dp_shard", "tp")
"""The fields a ``ParallelismConfig`` gives (:meth:`Par3DConfig.from_accelerate`)."""


def _config(par3d: Par3DConfig | None, parallelism_config: Any, values: dict[str, Any]) -> Par3DConfig:
    """The accelerator's config: ``par3d``, or the keyword fields in ``values`` (not both); or ``parallelism_config``
    converted, with the keyword fields it does not give."""
    if parallelism_config is None:
        return config_from("Par3DAccelerator", par3d, values, name="par3d")
    if par3d is not None:
        raise TypeError("Pass either par3d= or parallelism_config= to Par3DAccelerator, not both.")
    settings = explicit_settings(values)
    given = [name for name in changed_settings(settings) if name in _FROM_PARALLELISM_CONFIG]
    if given:
        raise TypeError(
            f"parallelism_config= gives dp_replicate, dp_shard and tp (its dp_replicate_size, dp_shard_size and "
            f"tp_size); got {', '.join(given)} too. Set them in the ParallelismConfig, or drop parallelism_config."
        )
    own = {name: value for name, value in settings.items() if name not in _FROM_PARALLELISM_CONFIG}
    return Par3DConfig.from_accelerate(parallelism_config, **own)


def _world_size() -> int:
    """The job's world size: the process group's if one exists (Lightning drops ``WORLD_SIZE`` from the environment
    when its Trainer tears down), else the launcher's ``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
