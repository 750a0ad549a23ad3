"""One training step of a model built by an engine: what ``layout="auto"`` times its candidates with
(:func:`measure_step`, handed to :mod:`lightning_par3d.planning.measuring`) and what a dry run runs
(:mod:`lightning_par3d.tools.dry_run`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par3d.planning.at_launch import Candidate
from lightning_par3d.planning.measuring import STEPS, WARMUP, MeasureWith, resized


def build_step(
    engine: Any, module: nn.Module | Callable[[], nn.Module], loss_fn: Callable[..., Tensor] | None
) -> tuple[nn.Module, Callable[[Any, int], None]]:
    """``module`` parallelized by ``engine``, and the function that runs one batch's forward and backward: the
    LightningModule's ``training_step`` (its model built by ``configure_model`` under the engine's init context;
    under pp its declared loss run by the pipeline), or for a model factory ``loss_fn(outputs, targets)`` through
    :meth:`Par3DEngine.train_step <lightning_par3d.engine.Par3DEngine.train_step>` (the batch ``(inputs,
    targets)``). Under ``bf16-true`` (``16-true``) the model is built in that dtype, as Lightning's precision plugin
    builds it. ``self.log`` has no Trainer to log to here: its warning is silenced."""
    from lightning_par3d.parallel.precision import autocast as autocast_for
    from lightning_par3d.parallel.precision import built_in
    from lightning_par3d.pipeline.trunk import install_loss

    if not hasattr(module, "training_step"):
        if loss_fn is None:
            raise ValueError("Running a plain model's training step needs loss_fn(outputs, targets).")
        if not isinstance(module, nn.Module):
            with engine.init_context(), built_in(engine.precision):
                module = module()
        model = engine.parallelize(module)

        def plain_step(batch: Any, index: int) -> None:
            inputs, *targets = batch
            with autocast_for(engine.precision, engine.device.type):
                engine.train_step(model, inputs, targets[0] if len(targets) == 1 else targets, loss_fn)

        return model, plain_step
    configure = getattr(module, "configure_model", None)
    if callable(configure):
        with engine.init_context(), built_in(engine.precision):
            configure()
    assert isinstance(module, nn.Module)
    model = engine.parallelize(module)
    spec = engine.pipeline_spec
    if spec is not None and spec.loss is not None:
        install_loss(module, spec.loss, engine.run_pipeline)

    def lightning_step(batch: Any, index: int) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")  # no Trainer to log to here
            with autocast_for(engine.precision, engine.device.type), _steps_through(model, module):
                out = model(batch, index) if model is not module else module.training_step(batch, index)
        loss = out["loss"] if isinstance(out, dict) else out
        if isinstance(loss, Tensor) and loss.requires_grad:  # under pp the schedule ran the backward already
            loss.backward()

    return model, lightning_step


@contextlib.contextmanager
def _steps_through(model: nn.Module, module: nn.Module) -> Iterator[None]:
    """Where ``model`` wraps ``module`` (pure replication: ``DistributedDataParallel``), the next call of the
    wrapper runs ``module.training_step``, so that the wrapper's gradient reduction runs as in the Trainer (whose
    wrapper redirects the forward the same way); ``training_step``'s own ``self(x)`` reaches ``forward`` as ever."""
    if model is module:
        yield
        return

    def once(*args: Any, **kwargs: Any) -> Any:
        del module.forward  # back to the class's forward before the step calls it
        step: Any = module.training_step
        return step(*args, **kwargs)

    module.forward = once
    try:
        yield
    finally:
        module.__dict__.pop("forward", None)


def module_optimizers(model: nn.Module, module: nn.Module, factory: Callable[[Any], Any] | None) -> list[Any]:
    """The LightningModule's ``configure_optimizers`` (an optimizer, a list, a dict with ``"optimizer"``, or
    ``(optimizers, schedulers)``), or ``factory(parameters)``, AdamW by default."""
    configure = getattr(module, "configure_optimizers", None)
    if factory is None and callable(configure):
        found = configure()
        if isinstance(found, tuple) and len(found) == 2 and isinstance(found[0], (list, tuple)):
            found = found[0]
        items = found if isinstance(found, (list, tuple)) else [found]
        return [item["optimizer"] if isinstance(item, dict) else item for item in items]
    params = [p for p in model.parameters() if p.requires_grad]
    return [factory(params) if factory is not None else torch.optim.AdamW(params)]


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or a dict, list or tuple of them, nested) with every tensor on ``device``."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def measure_step(candidate: Candidate, sample: MeasureWith, precision: str, device: torch.device) -> list[float]:
    """The measured steps of ``candidate`` (each the slowest rank's, the first ``WARMUP`` left out), on a fresh copy
    of the model; the same list on every rank."""
    from lightning_par3d.engine import Par3DEngine  # the engine's package imports this module

    config = dataclasses.replace(candidate.config, init="meta", async_save=False, elastic=False)
    engine = Par3DEngine(config, precision)
    engine.resolve(dist.get_world_size(), device.type)
    engine.setup(device)
    module = copy.deepcopy(sample.module)
    model, step = build_step(engine, module, sample.loss_fn)
    optimizers = engine.setup_optimizers(module_optimizers(model, engine.module, None))
    batch = to_device(resized(sample.batch, candidate.split.rank_batch), device)
    kept = []
    try:
        for index in range(WARMUP + STEPS):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(candidate.split.accumulate):
                step(batch, index)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= WARMUP:
                kept.append(time.perf_counter() - started)
    finally:
        engine.teardown()
    slowest = torch.tensor(kept, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [float(t) for t in slowest.tolist()]
