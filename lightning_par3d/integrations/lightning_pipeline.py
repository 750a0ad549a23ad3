"""The Trainer's steps under pipelining: the schedule runs forward and backward inside ``training_step``.

Lightning clears gradients between the step function and its backward call (its ``zero_grad`` hook), which would
discard the gradients the schedule just made. :class:`HeldGradients` takes them out of the parameters after the step
and puts them back when Lightning's backward (or, for a step that returned no loss, the optimizer step) comes; the
backward itself does not run twice (the strategy's ``training_step``, ``backward`` and ``optimizer_step``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:
    from lightning_par3d.engine import Par3DEngine


class HeldGradients:
    """Gradients held aside between a pipelined ``training_step`` and Lightning's backward call."""

    def __init__(self) -> None:
        self._held: dict[Tensor, Tensor] = {}

    def hold(self, module: nn.Module) -> None:
        """Takes the gradients out of ``module``'s parameters."""
        self._held = {p: p.grad for p in module.parameters() if p.grad is not None}
        for param in self._held:
            param.grad = None

    def restore(self) -> None:
        """Puts the held gradients back (nothing if none are held)."""
        for param, grad in self._held.items():
            param.grad = grad
        self._held = {}


class PipelinedTrainingSteps(ParallelStrategy):
    """The Trainer strategy's step hooks, translated to the engine: each batch starts the engine's batch (the token
    mean's window); without pp, Lightning's own step and backward, the loss scaled by
    :meth:`Par3DEngine.backward_factor <lightning_par3d.engine.Par3DEngine.backward_factor>`; under pp, the
    schedule's forward and backward inside ``training_step`` and the gradients held aside until Lightning's
    ``backward``."""

    engine: Par3DEngine
    _held_grads: HeldGradients

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pp the schedule runs forward and backward inside the step; the gradients it made are held aside
        until Lightning's backward call (Lightning clears gradients between the two: see
        :mod:`~lightning_par3d.integrations.lightning_pipeline`)."""
        assert self.lightning_module is not None
        self.engine.note_step(self.lightning_module.global_step)
        self.engine.start_batch()
        if self.engine.pipeline is None:
            return super().training_step(*args, **kwargs)
        self._held_grads.restore()
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        self.engine.clear_grads_first = batch_idx % self.engine.accumulate_grad_batches == 0
        output = super().training_step(*args, **kwargs)
        self._held_grads.hold(self.lightning_module)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Under pp the backward ran inside the step: the hooks around it run, the gradients come back. Under
        ``loss_mean="tokens"`` the backward takes ``1/w`` of a share, which Lightning divided by the accumulation."""
        if self.engine.pipeline is None:
            closure_loss = closure_loss * self.engine.backward_factor(self.engine.accumulate_grad_batches)
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._held_grads.restore()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._held_grads.restore()  # a step whose training_step returned no loss never reached backward
        return output
