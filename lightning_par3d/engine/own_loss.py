"""A pipelined transformers causal LM trained through its own ``labels=`` loss, as Hugging Face users write it::

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss        # the same code at every layout

Under pp the trunk's call with ``labels=`` runs the schedule at once (:func:`~lightning_par3d.pipeline.trunk.
attach_own_loss`): the labels leave the call (the stages take the ids and the masks), shifted as the model shifts
them, and the last stage applies the model's own ``loss_function`` to its logits; the token mean counts the shifted
labels, as it counts a transformers loss for pp = 1. The call comes back with ``.loss`` (and ``.aux_loss`` where the
model adds its router's load-balancing loss, :mod:`~lightning_par3d.engine.pipeline_router_loss`); the other fields
of the model's output (the logits) exist only inside the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.distributed.gather import map_tensors
from lightning_par3d.engine import pipeline_router_loss
from lightning_par3d.engine.context_rows import cut_call
from lightning_par3d.engine.router_loss import call_for, places_of
from lightning_par3d.parallel.context_parallel import context_parallel_of
from lightning_par3d.pipeline.runner import OwnLossOutput, PendingPipelineOutput
from lightning_par3d.pipeline.transformers_stages import IGNORE_INDEX, own_loss_of, shifted_labels
from lightning_par3d.pipeline.trunk import (
    PipelineHost,
    PipelineSpec,
    attach_forward_only,
    attach_own_loss,
    install_loss,
)
from lightning_par3d.utils.model_changes import set_attribute

if TYPE_CHECKING:
    from lightning_par3d.engine.engine import Par3DEngine

_ROUTER = "_par3d_pipelined_router"
"""The model's attribute holding its :class:`~lightning_par3d.engine.pipeline_router_loss.PipelinedRouterLoss`."""


def attach_runs(engine: Par3DEngine, module: nn.Module, spec: PipelineSpec | None) -> None:
    """Under pp (``spec`` not None): the trunk's forward-only calls and (a transformers causal LM) its calls with
    ``labels=`` run the engine's schedule, and so does the declared loss (a hosted model's loss is the front-end's
    ``train_step``)."""
    if spec is None:
        return
    trunk = getattr(module, spec.trunk)
    attach_forward_only(trunk, engine.forward_only)
    if not isinstance(module, PipelineHost) and spec.loss is not None:
        install_loss(module, spec.loss, engine.run_pipeline)
    if own_loss_of(trunk) is not None:
        attach_own_loss(trunk, engine.own_loss)


def check_router_joins(router: Any, own: bool) -> None:
    """Raises for a pipelined loss other than the model's own (``own``) while the model adds its router's loss."""
    if router is None or own:
        return
    raise ValueError(
        "The model adds its router's load-balancing loss (config.output_router_logits=True) to its own labels= "
        "loss, but under pp > 1 this loss gets only the last stage's logits, so the router's loss would be left out. "
        "Call the model with labels= and train on its .loss (self.model(**batch).loss: par3d adds the router's loss "
        "there, as the model does), or set output_router_logits=False (as Fabric's and Accelerate's train_step "
        "need: their loss_fn takes the logits)."
    )


def install_router(engine: Par3DEngine, module: nn.Module) -> pipeline_router_loss.PipelinedRouterLoss | None:
    """Under pp: the router loss of the model in ``module`` when it adds one (refused, naming the fix, where it
    cannot be computed at this layout), its hooks on this rank's stages; the previous engine's removed."""
    model = pipeline_router_loss.adds_router_loss(module)
    previous = getattr(model, _ROUTER, None) if model is not None else None
    if previous is not None:
        previous.remove()
    if model is None:
        return None
    problem = pipeline_router_loss.refusal(module, engine.layout.schedule)
    if problem is not None:
        raise ValueError(problem)
    runner = engine.pipeline
    assert runner is not None
    dp = engine.layout.dp_cp  # (the cp ranks route slices of the same rows: their counts sum with dp's)
    placement = engine.placement
    context = context_parallel_of(module) if engine.layout.cp > 1 else None
    router = pipeline_router_loss.PipelinedRouterLoss(
        model, runner.stage_modules, dp, (lambda: placement.dp_group()) if dp > 1 else (lambda: None),
        runner.pp_group, engine.device, context,
    )  # fmt: skip
    set_attribute(model, _ROUTER, router)
    return router


def run_own_loss(engine: Par3DEngine, pending: PendingPipelineOutput, trunk: nn.Module) -> OwnLossOutput:
    """Runs ``pending`` (the trunk's call, with ``labels=``) through the pipeline with the model's own loss, training
    (the module in training mode, gradients on) or forward only; returns it with ``loss`` (every rank) and, with
    the router's loss, ``aux_loss`` set."""
    loss_fn = own_loss_of(trunk)
    assert loss_fn is not None, "attach_own_loss on a model without its own loss"
    call, targets = _without_labels(pending)
    train = engine.module.training and torch.is_grad_enabled()
    router = engine.router
    if not train:  # the batch's token mean, as the model computes it whole (not the mean of microbatch means)
        loss_fn = _batch_token_mean(loss_fn, targets, engine)

    context = context_parallel_of(engine.module) if engine.layout.cp > 1 else None

    def run() -> torch.Tensor:
        loss = engine.run_pipeline(call, targets, loss_fn, train=train, own=True)
        if not train and context is not None:  # each cp rank summed its slices' token losses: the rows' are theirs
            dist.all_reduce(loss, group=context.group)
        return loss

    if router is None:
        return OwnLossOutput(pending.args, pending.kwargs, loss=run())
    if not train:
        loss, aux = router.evaluated(run)
    else:
        entry = engine.token_mean.current if engine.token_mean is not None else None
        accumulate = engine.accumulate_grad_batches
        if accumulate > 1 and entry is None:
            raise ValueError(
                f"The model's router load-balancing loss (output_router_logits=True) is a product of two means over "
                f"the global batch, whose {accumulate} accumulated batches par3d routes ahead from the dataloader it "
                "reads ahead for the token mean; this batch came from none (loss_mean='microbatches', or a loop par3d "
                "did not set up). Use loss_mean='tokens' (the default) with the front-end's dataloader, drop the "
                "accumulation, or set output_router_logits=False."
            )
        index, batches = (entry.index, entry.batches) if entry is not None else (0, 1)
        if index == 0:
            calls = [call, *_later_calls(engine, pending, entry)]
            runner = engine.pipeline
            assert runner is not None
            context = router.context  # under cp each call is cut to this rank's positions, as the training one is
            router.route_ahead(calls, lambda c: runner.predict(cut_call(c, None, context)[0] if context else c,
                                                               engine.device, apart=True))  # fmt: skip
        loss, aux = router.trained(run, index, batches)
    return OwnLossOutput(pending.args, pending.kwargs, loss=loss, aux_loss=aux)


def _batch_token_mean(loss_fn: Callable[[Any, Any], torch.Tensor], targets: torch.Tensor,
                     engine: Par3DEngine) -> Callable[[Any, Any], torch.Tensor]:  # fmt: skip
    """``loss_fn`` (a microbatch's token mean) weighed so that the schedule's mean over the microbatches is the
    whole batch's token mean: ``mean · count · microbatches / total`` (a forward-only run, which averages the
    microbatches' losses)."""
    runner = engine.pipeline
    assert runner is not None
    total = int((targets != IGNORE_INDEX).sum())
    pieces = runner.microbatches_for(targets.shape[0])

    def weighed(logits: Any, microbatch_targets: torch.Tensor) -> torch.Tensor:
        mean = loss_fn(logits, microbatch_targets)
        if total == 0:
            return mean  # (no real token: the model's own mean, NaN, as one process gets it)
        count = int((microbatch_targets != IGNORE_INDEX).sum())
        return torch.where(torch.tensor(count > 0), mean, 0.0) * (count * pieces / total)

    return weighed


def _without_labels(pending: PendingPipelineOutput) -> tuple[PendingPipelineOutput, torch.Tensor]:
    """The call without its ``labels`` (the stages do not take them), and the labels shifted as the model's loss
    shifts them."""
    kwargs = {k: v for k, v in pending.kwargs.items() if k != "labels"}
    return PendingPipelineOutput(pending.args, kwargs), shifted_labels(pending.kwargs["labels"])


def _later_calls(engine: Par3DEngine, pending: PendingPipelineOutput, entry: Any) -> list[PendingPipelineOutput]:
    """The calls of the window's later batches, made from this call (each tensor argument replaced by the later
    batch's tensor at the place this one's is in its batch), without their labels."""
    if entry is None or not entry.later:
        return []

    def prepare(batch: Any) -> Any:
        return map_tensors(lambda t: t.to(engine.device), batch)

    places = places_of(prepare(entry.batch), pending.args, pending.kwargs)
    calls = []
    for batch in entry.later:
        args, kwargs = call_for(places, prepare(batch), pending.args, pending.kwargs)
        calls.append(_without_labels(PendingPipelineOutput(args, kwargs))[0])
    return calls
