"""How a model declares its pipeline, and how its trunk and loss behave once pipelined.

The model (a LightningModule, or any ``nn.Module``) declares, once, its pipelined trunk and its loss::

    class GPTModule(L.LightningModule):
        pipeline_trunk = "model"     # the attribute holding the module to split into stages
        pipeline_loss = "loss_fn"    # a method (trunk outputs, targets) -> scalar loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.model(x), y)   # the same code at every layout

Under ``pp > 1`` the trunk attribute holds this rank's stages (grafted at their original names) and calling it
returns a :class:`~lightning_par3d.pipeline.runner.PendingPipelineOutput` instead of running; the loss method, given
that, asks the ``run_pipeline`` callable it was installed with to run the whole schedule for the batch, and returns
the batch's mean loss. Plain scripts (Fabric, Accelerate, a torch loop) hand their model to
:class:`PipelineHost`, which declares both for them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_par3d.pipeline.runner import OwnLossOutput, PendingPipelineOutput
from lightning_par3d.utils.model_changes import set_attribute, swap_class


@dataclass(frozen=True)
class PipelineSpec:
    """The names a model declares for pipelining: its trunk attribute and its loss method (None: a transformers
    causal LM trained with its own ``labels=`` loss only, :func:`attach_own_loss`)."""

    trunk: str
    loss: str | None


def declared_pipeline(module: nn.Module) -> PipelineSpec:
    """The module's ``pipeline_trunk`` and ``pipeline_loss`` names, checked. A trunk that is a transformers causal
    LM needs no ``pipeline_loss`` when the module trains it with its own ``labels=`` loss."""
    from lightning_par3d.pipeline.transformers_stages import own_loss_of

    trunk, loss = getattr(module, "pipeline_trunk", None), getattr(module, "pipeline_loss", None)
    trunk_module = getattr(module, trunk, None) if isinstance(trunk, str) else None
    own = loss is None and isinstance(trunk_module, nn.Module) and own_loss_of(trunk_module) is not None
    if not isinstance(trunk, str) or not (isinstance(loss, str) or own):
        raise TypeError(
            f"pp > 1 needs {type(module).__name__} to declare `pipeline_trunk = '<attribute of the module to split>'` "
            "and `pipeline_loss = '<method (outputs, targets) -> loss>'` as class attributes (see "
            "lightning_par3d.pipeline.trunk); a transformers causal LM trained through its own labels= loss needs "
            "pipeline_trunk only."
        )
    if not isinstance(trunk_module, nn.Module):
        raise TypeError(f"pipeline_trunk={trunk!r}, but {type(module).__name__}.{trunk} is not an nn.Module.")
    if loss is not None and not callable(getattr(module, loss, None)):
        raise TypeError(f"pipeline_loss={loss!r}, but {type(module).__name__}.{loss} is not a method.")
    return PipelineSpec(trunk, loss)


def pipeline_loss_of(module: nn.Module, spec: PipelineSpec) -> Callable[..., torch.Tensor]:
    """The loss the last stage applies, ``(outputs, targets) -> loss``: the declared method, or the trunk's own
    ``labels=`` loss (given the labels unshifted, as the model is)."""
    if spec.loss is not None:
        return getattr(module, spec.loss)
    from lightning_par3d.pipeline.transformers_stages import own_loss_of, shifted_labels

    own = own_loss_of(getattr(module, spec.trunk))
    assert own is not None, "declared_pipeline allows no loss only for a model with its own"
    return lambda outputs, labels: own(outputs, shifted_labels(labels))


def check_only_trunk_has_parameters(module: nn.Module, trunk_attr: str) -> None:
    """Under pp every parameter must belong to a stage, hence to the trunk."""
    outside = [n for n, _ in module.named_parameters() if not n.startswith(trunk_attr + ".")]
    if outside:
        raise TypeError(
            f"Under pp > 1 every parameter must live in the pipelined trunk {type(module).__name__}.{trunk_attr}; "
            f"these do not: {', '.join(outside[:5])}. Move them into the trunk."
        )


def install_trunk(module: nn.Module, trunk_attr: str, holder: nn.Module) -> None:
    """Puts ``holder`` (this rank's stages at their original names) in place of the trunk and makes calling it
    return a :class:`PendingPipelineOutput`."""
    swap_class(holder, _PipelinedTrunk, "Pipelined")
    module.register_module(trunk_attr, holder)


RunPipeline = Callable[[PendingPipelineOutput, Any, Callable[[Any, Any], torch.Tensor]], torch.Tensor]
"""``(pending, targets, user_loss) -> mean loss``: runs the schedule for one batch."""


def install_loss(module: nn.Module, loss_attr: str, run_pipeline: RunPipeline) -> None:
    """Makes the module's loss method, given a :class:`PendingPipelineOutput`, run the schedule through
    ``run_pipeline`` with the original loss; given real outputs it is the original loss. Installing again (the
    model reused by another engine) only points the loss at the new ``run_pipeline``."""
    current = getattr(module, loss_attr)
    if isinstance(current, PipelinedLoss):
        current.run_pipeline = run_pipeline
        return
    set_attribute(module, loss_attr, PipelinedLoss(current, run_pipeline))


class PipelinedLoss:
    """The model's loss method under pp: with a :class:`PendingPipelineOutput` (what the pipelined trunk returns)
    it runs the whole schedule for the batch and returns the batch's mean loss; with real outputs (inside the
    schedule, on the last stage) it is the model's own loss."""

    def __init__(self, user_loss: Callable[..., torch.Tensor], run_pipeline: RunPipeline) -> None:
        self.user_loss = user_loss
        self.run_pipeline = run_pipeline

    def __call__(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(outputs, PendingPipelineOutput):
            if isinstance(outputs, OwnLossOutput):  # the trunk was called with labels=: its loss ran, backward too
                raise ValueError(
                    "Under pp > 1 a call of the pipelined model with labels= runs the model's own loss (forward and "
                    "backward) at once, so this output cannot go to the declared pipeline_loss too (the batch would "
                    "train twice). Return the output's .loss, or call the model without labels=."
                )
            return self.run_pipeline(outputs, targets, self.user_loss)
        return self.user_loss(outputs, targets, *args, **kwargs)


FORWARD_ONLY = "_par3d_forward_only"
"""The trunk's attribute holding (a weak reference to) the engine's forward-only run (:func:`attach_forward_only`)."""


OWN_LOSS = "_par3d_own_loss"
"""The trunk's attribute holding (a weak reference to) the engine's run of the model's own loss
(:func:`attach_own_loss`)."""


def attach_own_loss(trunk: nn.Module, run: Callable[[nn.Module, PendingPipelineOutput], PendingPipelineOutput]) -> None:
    """Makes a call of the pipelined ``trunk`` (a transformers causal LM) that passes ``labels=`` run the schedule
    with the model's own loss at once: ``run(trunk, pending)`` returns the call with its ``loss`` (and, for a
    mixture of experts adding its router's loss, ``aux_loss``) set, as the model's output has them; held by a weak
    reference, as :func:`attach_forward_only`'s."""
    set_attribute(trunk, OWN_LOSS, weakref.WeakMethod(run))


def attach_forward_only(trunk: nn.Module, run: Callable[[PendingPipelineOutput], Any]) -> None:
    """Makes a call of the pipelined ``trunk`` outside training (in eval mode, or with gradients off) run the
    schedule at once, forward only, and return the real outputs on every pipeline rank: ``run(pending)``, held by a
    weak reference so that the model keeps nothing of the engine alive."""
    set_attribute(trunk, FORWARD_ONLY, weakref.WeakMethod(run))


class _PipelinedTrunk(nn.Module):
    """Mixed into the trunk's class under pp. In training (train mode, gradients on) calling it defers the
    computation to the pipeline schedule, which the loss runs with the backward; in a forward-only step (validation,
    test, prediction, ``torch.no_grad()``) it runs the schedule at once and returns the last stage's outputs on every
    pipeline rank, so that code computing from them (an argmax, a metric) works as at any other layout."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pending = PendingPipelineOutput(args, kwargs)
        if kwargs.get("labels") is not None:  # a transformers causal LM's own loss: run for its .loss, at any step
            own = self.__dict__.get(OWN_LOSS)
            run_own = own() if own is not None else None
            if run_own is not None:
                return run_own(self, pending)
        reference = self.__dict__.get(FORWARD_ONLY)
        run = reference() if reference is not None else None
        if run is None or (self.training and torch.is_grad_enabled()):
            return pending
        return run(pending)


class PipelineHost(nn.Module):
    """Holds a plain model as the pipelined trunk, for scripts that have no LightningModule to declare one. The
    model object itself becomes this rank's stages, so the script's references to it stay valid and its state dict
    keeps the original names (under ``trunk.``)."""

    pipeline_trunk = "trunk"
    pipeline_loss = "loss"

    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.trunk(*args, **kwargs)

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        raise RuntimeError(
            "A pipelined model computes its loss inside the schedule: call the engine's (or the front-end's) "
            "train_step (Fabric: fabric.strategy.train_step) with your loss function."
        )
