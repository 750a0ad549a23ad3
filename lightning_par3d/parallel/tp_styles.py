"""The torch ``ParallelStyle`` of each tensor-parallel style string (the strings and what they mean:
:mod:`lightning_par3d.config.tp_vocabulary`), and the dimension each one splits."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_par3d.config.tp_vocabulary import PACK, canonical, unknown_style_message

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def split_size(style: str, module: nn.Module) -> tuple[str, int] | None:
    """The attribute name and size of the dimension ``style`` splits on ``module`` (None if none or unknown); for
    packed styles, the size of one component."""
    from torch import nn

    style = canonical(style)
    if isinstance(module, nn.Embedding):
        if style in ("rowwise", "rowwise_split_input", "embedding_rowwise"):
            return "num_embeddings", module.num_embeddings
        if style in ("colwise", "colwise_gather_output", "embedding_colwise"):
            return "embedding_dim", module.embedding_dim
    if isinstance(module, nn.Linear):
        if style in ("colwise", "colwise_gather_output", "colwise_seq", "colwise_seq_gather_output"):
            return "out_features", module.out_features
        if style in ("rowwise", "rowwise_split_input", "rowwise_seq"):
            return "in_features", module.in_features
        if style == "packed_colwise":
            return f"out_features / {PACK}", module.out_features // PACK
        if style == "packed_rowwise":
            return f"in_features / {PACK}", module.in_features // PACK
    return None


def build_style(style: str, module: nn.Module, params: dict[str, str] | None = None) -> ParallelStyle:
    """The torch ``ParallelStyle`` for ``style`` on ``module``; ``params``: the plan's entries naming parameters of
    ``module`` (parameter name → style), for the styles that run on local shards."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    style = canonical(style)
    is_embedding = isinstance(module, nn.Embedding)
    simple: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(input_layouts=Replicate()) if is_embedding else RowwiseParallel(),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_seq": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "colwise_seq": lambda: ColwiseParallel(input_layouts=Shard(1)),
        "colwise_seq_gather_output": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }
    if style in simple:
        return simple[style]()
    from lightning_par3d.parallel import tp_local_styles, tp_sequence_styles

    custom: dict[str, Callable[[], ParallelStyle]] = {
        "packed_colwise": lambda: tp_local_styles.PackedLinear(dim=0, pack=PACK),
        "packed_rowwise": lambda: tp_local_styles.PackedLinear(dim=1, pack=PACK),
        "replicated_with_grad_allreduce": tp_local_styles.GradAllReduce,
        "all_reduce": tp_local_styles.OutputAllReduce,
        "local_params": lambda: tp_local_styles.LocalParams(params or {}),
        "moe_tp_experts": lambda: tp_local_styles.MoeExperts(params or {}),
        "replicate": _replicate_style,
        "sequence_shard": tp_sequence_styles.SequenceShard,
        "gather_sequence": tp_sequence_styles.GatherSequence,
        "whole_sequence": tp_sequence_styles.WholeSequence,
    }
    if style in custom:
        return custom[style]()
    raise ValueError(unknown_style_message("?", style))


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
