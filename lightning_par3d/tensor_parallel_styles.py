"""Tensor-parallel style strings and the torch ``ParallelStyle`` each one stands for.

The names are Hugging Face transformers' ``tp_plan`` strings, so a transformers model's plan works as it is:

========================  ==========================================================================================
``colwise``               ``ColwiseParallel()``: shard the weight's output dim; the output stays sharded on its
                          last dim (attention computes its local heads from it). On ``nn.Embedding``: shard the
                          embedding dim.
``rowwise``               ``RowwiseParallel()``: shard the weight's input dim; the partial outputs are all-reduced.
                          On ``nn.Embedding``: shard the vocabulary (token ids arrive replicated).
``colwise_rep``           ``ColwiseParallel(output_layouts=Replicate())``: as colwise, then all-gather the output
                          (a vocabulary-parallel LM head whose logits every rank needs).
``rowwise_rep``           ``RowwiseParallel(input_layouts=Replicate())``: as rowwise for a layer whose input is
                          replicated; each rank takes its slice of the input.
``sequence_parallel``     ``SequenceParallel()``: a norm or dropout computed on sequence-sharded activations.
``replicate``             parameters become replicated DTensors over the tp group; inputs and outputs stay local.
``embedding_rowwise``     vocabulary-sharded ``nn.Embedding`` (the same as ``rowwise`` on an embedding).
``rowwise_seq``           par3d: ``RowwiseParallel(output_layouts=Shard(1))``, reduce-scatter into sequence shards,
                          the entry to a sequence-parallel region.
``colwise_seq``           par3d: ``ColwiseParallel(input_layouts=Shard(1))``, all-gather the sequence shards first,
                          the exit from a sequence-parallel region.
========================  ==========================================================================================

``sequence_parallel`` expects sequence-sharded input, so use it between a ``rowwise_seq`` and a ``colwise_seq``
(the Megatron sequence-parallel pattern): norms and dropout then run on 1/tp of the tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "sequence_parallel",
    "replicate",
    "embedding_rowwise",
    "rowwise_seq",
    "colwise_seq",
)

# Styles that split a weight matrix, and which dim of the module they split, for divisibility checks.
SPLITTING_STYLES = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "rowwise_rep",
    "embedding_rowwise",
    "rowwise_seq",
    "colwise_seq",
)


def split_size(style: str, module: nn.Module) -> tuple[str, int] | None:
    """The attribute name and size of the dimension ``style`` splits on ``module`` (None if none or unknown)."""
    from torch import nn

    if isinstance(module, nn.Embedding):
        if style in ("rowwise", "rowwise_rep", "embedding_rowwise"):
            return "num_embeddings", module.num_embeddings
        if style in ("colwise", "colwise_rep"):
            return "embedding_dim", module.embedding_dim
    if isinstance(module, nn.Linear):
        if style in ("colwise", "colwise_rep", "colwise_seq"):
            return "out_features", module.out_features
        if style in ("rowwise", "rowwise_rep", "rowwise_seq"):
            return "in_features", module.in_features
    return None


def build_style(style: str, module: nn.Module) -> ParallelStyle:
    """The torch ``ParallelStyle`` for ``style`` on ``module``."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    is_embedding = isinstance(module, nn.Embedding)
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise" or (style == "rowwise" and is_embedding):
        return RowwiseParallel(input_layouts=Replicate())
    if style == "rowwise":
        return RowwiseParallel()
    if style == "rowwise_rep":
        return RowwiseParallel(input_layouts=Replicate())
    if style == "rowwise_seq":
        return RowwiseParallel(output_layouts=Shard(1))
    if style == "colwise_seq":
        return ColwiseParallel(input_layouts=Shard(1))
    if style == "sequence_parallel":
        return SequenceParallel()
    if style == "replicate":
        return _replicate_style()
    raise ValueError(f"Unknown tensor-parallel style {style!r}. Allowed: {', '.join(STYLE_NAMES)}.")


def _replicate_style() -> ParallelStyle:
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    def to_dtensor(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _is_plain_tensor(x) else x for x in inputs
        )

    def to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    class ReplicateParallel(ParallelStyle):
        """Replicates a module's parameters over the tp group as DTensors, so that every parameter of a
        tensor-parallel model lives on the same mesh (one gradient-norm reduction, one optimizer code path)."""

        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            return distribute_module(module, device_mesh, None, to_dtensor, to_local)

    return ReplicateParallel()


def _is_plain_tensor(x: Any) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
