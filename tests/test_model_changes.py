"""What par3d changes on a user's model goes through one module (:mod:`lightning_par3d.utils.model_changes`):
the classes it makes are cached, every change is listed, and ``undo`` takes them back."""

from __future__ import annotations

import torch
from torch import nn

from lightning_par3d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_par3d.pipeline.trunk import PipelinedLoss, install_loss, install_trunk
from lightning_par3d.utils.model_changes import changes, original_class, set_attribute, temporarily, undo


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).relu()


class Model(nn.Module):
    pipeline_trunk = "trunk"
    pipeline_loss = "loss"

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential()
        self.trunk.blocks = nn.ModuleDict({str(i): Block() for i in range(3)})

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (outputs - targets).pow(2).mean()


def test_classes_are_made_once_and_every_change_is_listed_and_undone():
    first, second = Model(), Model()
    for model in (first, second):
        apply_activation_checkpointing(model, "full", None, 2)
    blocks = [*first.trunk.blocks.values(), *second.trunk.blocks.values()]
    assert len({type(b) for b in blocks}) == 1, "one checkpointed class per block class, shared"
    assert type(blocks[0]).__name__ == "CheckpointedBlock" and original_class(blocks[0]) is Block

    install_trunk(first, "trunk", first.trunk)
    install_loss(first, "loss", lambda pending, targets, loss: torch.zeros(()))
    assert isinstance(first.loss, PipelinedLoss)
    listed = "\n".join(changes(first))
    assert "trunk: class Sequential → PipelinedSequential" in listed
    assert "trunk.blocks.0: class Block → CheckpointedBlock" in listed
    assert "Model.loss: set by par3d" in listed

    x = torch.randn(2, 4)
    undo(first)
    assert type(first.trunk) is nn.Sequential and all(type(b) is Block for b in first.trunk.blocks.values())
    assert first.loss(x, x).item() == 0.0 and not isinstance(first.loss, PipelinedLoss)
    assert changes(first) == []
    assert type(second.trunk.blocks["0"]).__name__ == "CheckpointedBlock", "undo touches only the model given"


def test_an_attribute_set_for_a_call_is_gone_after_it():
    model = Model()
    with temporarily(model, "log", print):
        assert model.log is print  # type: ignore[attr-defined]
    assert "log" not in model.__dict__
    set_attribute(model, "forward", lambda x: x)
    undo(model)
    assert "forward" not in model.__dict__
