"""The Trainer's steps under pipelining: the schedule runs forward and backward inside ``training_step``.

Lightning clears gradients between the step function and its backward call (its ``zero_grad`` hook), which would
discard the gradients the schedule just made. :class:`HeldGradients` takes them out of the parameters after the step
and puts them back when Lightning's backward (or, for a step that returned no loss, the optimizer step) comes; the
backward itself does not run twice (the strategy's ``training_step``, ``backward`` and ``optimizer_step``).
"""

from __future__ import annotations

from torch import Tensor, nn


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
