"""One training step of a model built by an engine: what ``layout="auto"`` measures candidates with
(:mod:`lightning_par3d.engine.measure`) and what a dry run runs (:mod:`lightning_par3d.tools.dry_run`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn


def build_step(
    engine: Any, module: nn.Module | Callable[[], nn.Module], loss_fn: Callable[..., Tensor] | None
) -> tuple[nn.Module, Callable[[Any, int], None]]:
    """``module`` parallelized by ``engine``, and the function that runs one batch's forward and backward: the
    LightningModule's ``training_step`` (its model built by ``configure_model`` under the engine's init context;
    under pp its declared loss run by the pipeline), or for a model factory ``loss_fn(outputs, targets)`` through
    :meth:`Par3DEngine.train_step <lightning_par3d.engine.Par3DEngine.train_step>` (the batch ``(inputs,
    targets)``). ``self.log`` has no Trainer to log to here: its warning is silenced."""
    from lightning_par3d.parallel.precision import autocast as autocast_for
    from lightning_par3d.pipeline.trunk import install_loss

    if not hasattr(module, "training_step"):
        if loss_fn is None:
            raise ValueError("Running a plain model's training step needs loss_fn(outputs, targets).")
        if not isinstance(module, nn.Module):
            with engine.init_context():
                module = module()
        model = engine.parallelize(module)

        def plain_step(batch: Any, index: int) -> None:
            inputs, *targets = batch
            with autocast_for(engine.precision, engine.device.type):
                engine.train_step(model, inputs, targets[0] if len(targets) == 1 else targets, loss_fn)

        return model, plain_step
    configure = getattr(module, "configure_model", None)
    if callable(configure):
        with engine.init_context():
            configure()
    assert isinstance(module, nn.Module)
    model = engine.parallelize(module)
    spec = engine.pipeline_spec
    if spec is not None:
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
