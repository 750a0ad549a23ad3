"""``self.log`` under pipelining: what the last stage logs, every stage logs.

Under ``pp > 1`` the module's loss method runs inside the pipeline schedule, on the last stage only, once per
microbatch. A value it logs (``self.log("val_acc", self.acc)``, a perplexity, a token count) would exist on the last
stage's ranks alone: the other ranks would lack the key (``ModelCheckpoint(monitor=...)`` fails there), and
``sync_dist`` reductions, which pair tensors by call order, would pair different keys across ranks (Lightning's
known data corruption when ranks log different keys). :class:`LogRelay` records the ``self.log`` calls the loss
makes on the last stage, sends them to the other pipeline ranks after the schedule, and replays them there, in the
same order, with the last stage's values (a logged torchmetrics metric is replayed as the rank's own metric of the
same name, which syncs to the last stage's value). Every rank then logs the same keys in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par3d.engine import Par3DEngine
from lightning_par3d.pipeline.runner import PendingPipelineOutput
from lightning_par3d.utils.model_changes import temporarily

LossFn = Callable[..., torch.Tensor]


class LogRelay:
    """Runs the pipeline for a LightningModule's pipelined loss, relaying the loss's ``self.log`` calls from the last
    stage to every pipeline rank."""

    def __init__(self, engine: Par3DEngine, module: nn.Module) -> None:
        self.engine = engine
        self.module = module

    def __call__(self, pending: PendingPipelineOutput, targets: Any, user_loss: LossFn) -> torch.Tensor:
        runner = self.engine.pipeline
        assert runner is not None
        records: list[tuple[Any, ...]] = []
        loss_fn = self._recording(user_loss, records) if runner.holds_last_stage else user_loss
        loss = self.engine.run_pipeline(pending, targets, loss_fn)
        records = runner.broadcast_object_from_last_stage(records if runner.holds_last_stage else None)
        if not runner.holds_last_stage:
            for name, value, args, kwargs in records:
                self.module.log(name, self._value(value), *args, **kwargs)  # type: ignore[operator]
        return loss

    def _recording(self, user_loss: LossFn, records: list[tuple[Any, ...]]) -> LossFn:
        module = self.module
        real_log = type(module).log  # type: ignore[attr-defined]

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            records.append((name, self._portable(value), args, kwargs))
            real_log(module, name, value, *args, **kwargs)

        def loss(outputs: Any, targets: Any) -> torch.Tensor:
            with temporarily(module, "log", log):
                return user_loss(outputs, targets)

        return loss

    def _portable(self, value: Any) -> tuple[str, Any]:
        """What crosses to the other stages: a tensor's value, a metric's name in the module, or the value."""
        if isinstance(value, torch.Tensor):
            return ("tensor", value.detach().cpu())
        if isinstance(value, nn.Module):
            for name, sub in self.module.named_modules():
                if sub is value:
                    return ("module", name)
            raise ValueError(
                f"A {type(value).__name__} logged under pp must be an attribute of the LightningModule, so that every "
                "pipeline stage logs its own copy of it."
            )
        return ("value", value)

    def _value(self, portable: tuple[str, Any]) -> Any:
        kind, value = portable
        if kind == "tensor":
            return value.to(self.engine.device)
        if kind == "module":
            return self.module.get_submodule(value)
        return value
