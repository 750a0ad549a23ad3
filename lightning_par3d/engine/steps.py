"""The engine's steps: one batch forward (and backward) at any layout, gradient accumulation, and clipping.

Without pipelining a step is the model's call, the loss and ``backward``; under pp the pipeline schedule runs both,
microbatched (:class:`~lightning_par3d.pipeline.runner.PipelineRunner`). ``inputs`` is a tensor, a tuple of
positional arguments or a dict of keyword arguments, under every layout alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_par3d.distributed.gradients import clip_grads_
from lightning_par3d.parallel.data_parallel import no_gradient_sync
from lightning_par3d.pipeline.runner import PendingPipelineOutput
from lightning_par3d.zero.optimizer import ZeroOptimizer, optimizer_grads

LossFn = Callable[[Any, Any], torch.Tensor]


def call(model: nn.Module, inputs: Any) -> Any:
    """``model`` called with ``inputs``: keyword arguments from a mapping, positional ones from a tuple, else one."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def pending(inputs: Any) -> PendingPipelineOutput:
    """``inputs`` as a pipelined trunk's call keeps them until the schedule runs."""
    if isinstance(inputs, Mapping):
        return PendingPipelineOutput((), dict(inputs))
    if isinstance(inputs, tuple):
        return PendingPipelineOutput(inputs, {})
    return PendingPipelineOutput((inputs,), {})


def plain_train_step(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Callable[[torch.Tensor], Any] | None
) -> torch.Tensor:
    """Without pipelining: ``loss_fn(model(inputs), targets)``, then ``backward(loss)`` (default
    ``loss.backward()``); the loss, detached."""
    with torch.enable_grad():
        loss = loss_fn(call(model, inputs), targets)
    (backward or torch.Tensor.backward)(loss)
    return loss.detach()


@contextmanager
def no_sync(forward_module: nn.Module, zero: Sequence[ZeroOptimizer]) -> Iterator[None]:
    """Backward passes inside keep their gradients local (the non-final batches of gradient accumulation): DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``, the ZeRO wrappers' held reduction."""
    with ExitStack() as stack:
        stack.enter_context(no_gradient_sync(forward_module))
        for optimizer in zero:
            stack.enter_context(optimizer.no_sync())
        yield


def clip_grad_norm(
    source: Optimizer | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float,
    zero: Sequence[ZeroOptimizer],
    pp_group: Any,
) -> torch.Tensor:
    """Scales the gradients of ``source`` (an optimizer, possibly wrapped by a framework, or parameters) so that
    their norm over every tp, dp and pp shard is at most ``max_norm``; returns the norm before clipping. Under
    ZeRO-2, where each rank holds only its rows of the gradients, those rows are clipped either way."""
    zero2 = [z for z in zero if z.stage == 2]
    if isinstance(source, Optimizer):
        grads = optimizer_grads(getattr(source, "_optimizer", source))  # Lightning's and Fabric's wrappers
    elif zero2:
        grads = [g for optimizer in zero2 for g in optimizer_grads(optimizer)]
    else:
        grads = [p.grad for p in source if p.grad is not None]
    return clip_grads_(grads, float(max_norm), float(norm_type), pp_group)
