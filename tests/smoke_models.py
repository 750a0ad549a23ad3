"""A model planted to diverge under tensor parallelism, for the smoke command's tests (``tests/test_smoke.py``)."""

from __future__ import annotations

import torch

from examples.gpt import MLP, GPTModule


class ShardDependentMLP(MLP):
    """The example's MLP, its output scaled by the share of its first projection's weight this rank holds: 1 in one
    process, ½ at tp=2 (the ``.to_local()`` where the whole tensor was meant: a bug that trains, and only drifts), so
    the output depends on the layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.c_fc.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        return super().forward(x) * (local.numel() / weight.numel())


class ShardDependentGPT(GPTModule):
    """The example GPT with :class:`ShardDependentMLP` in every block."""

    def configure_model(self) -> None:
        super().configure_model()
        assert self.model is not None
        for block in self.model.transformer.h.values():  # a ModuleDict (its names stay those of one process)
            block.mlp.__class__ = ShardDependentMLP
