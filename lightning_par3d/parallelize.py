"""The one function that applies every parallelism, in a fixed order.

``parallelize(module, mesh, config, device)`` expects the model as ``configure_model`` left it: on the meta device
(or real on rank 0 with ``init="rank0"``). In order, it

1. checks the tensor-parallel plan against the model (patterns, divisibility, head counts) on every rank, before
   any data moves, so that a bad plan raises the same error everywhere instead of hanging a collective;
2. keeps rank 0's real weights aside and moves the model to meta;
3. applies tensor parallelism (``parallelize_module``) over the ``tp`` mesh;
4. applies FSDP2 ``fully_shard`` per block, then at the root, over the data-parallel mesh;
5. materializes each rank's shards on ``device`` and fills them from rank 0 (or with ``reset_parameters()``).

Pipeline splitting (before 3) and activation checkpointing (between 3 and 4) slot into this order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_par3d.config import Par3DConfig
from lightning_par3d.data_parallel import find_blocks, replicate_with_ddp, shard_data_parallel, uses_ddp
from lightning_par3d.materialize import capture_rank0_state, materialize, sync_rng_from_rank0
from lightning_par3d.mesh import Par3DMesh
from lightning_par3d.tensor_parallel import apply_tensor_parallel, check_divisibility, expand_plan, find_plan


@dataclass(frozen=True)
class ParallelizeReport:
    """What :func:`parallelize` did, for the log line."""

    data_parallel: str
    tp_modules: int
    initialized_from: str

    def __str__(self) -> str:
        return (
            f"data parallel: {self.data_parallel}; tensor-parallel modules: {self.tp_modules}; "
            f"weights from {self.initialized_from}"
        )


def parallelize(
    module: nn.Module, mesh: Par3DMesh, config: Par3DConfig, device: torch.device
) -> tuple[nn.Module, ParallelizeReport]:
    """Applies tensor and data parallelism to ``module`` and materializes it on ``device``.

    Returns the module to train: ``module`` itself (parallelized in place), or, for pure replication without
    tensor parallelism, ``module`` wrapped in ``DistributedDataParallel``.
    """
    import torch.distributed as dist

    layout = mesh.layout
    fqn_styles: dict[str, str] = {}
    if layout.tp > 1:
        plan = find_plan(module, config.tp_plan)
        if not plan:
            raise ValueError(
                f"tp={layout.tp} but {type(module).__name__} declares no tensor-parallel plan. Give the "
                "LightningModule a `tp_plan` attribute (module-name pattern → style), or set strategy.tp_plan."
            )
        fqn_styles = expand_plan(module, plan)
        check_divisibility(module, fqn_styles, layout.tp)
    blocks = find_blocks(module, config.fsdp_blocks) if layout.dp > 1 and layout.dp_shard > 1 else []

    rank = dist.get_rank()
    state = capture_rank0_state(module, rank)
    from_rank0 = _any_rank0(state.captured)

    apply_tensor_parallel(module, mesh["tp"], fqn_styles)
    shard_data_parallel(module, mesh, blocks, reshard_after_forward=config.reshard_after_forward)
    materialize(module, device, state, source_is_rank0=from_rank0)
    sync_rng_from_rank0()
    report = ParallelizeReport(
        data_parallel=_describe_data_parallel(mesh, len(blocks)),
        tp_modules=len(fqn_styles),
        initialized_from="rank 0 (broadcast)" if from_rank0 else "reset_parameters() on each rank",
    )
    if uses_ddp(mesh):
        return replicate_with_ddp(module, mesh, device), report
    return module, report


def _describe_data_parallel(mesh: Par3DMesh, blocks: int) -> str:
    layout = mesh.layout
    if layout.dp == 1:
        return "none"
    if uses_ddp(mesh):
        return f"DDP over {layout.dp} replicas"
    if layout.dp_shard == 1:
        return f"FSDP2 replicated over {layout.dp} ranks (one unit)"
    kind = "HSDP" if layout.dp_replicate > 1 else "FSDP2"
    return f"{kind} ({blocks} blocks + root)"


def _any_rank0(captured: bool) -> bool:
    """Whether rank 0 captured real weights; all ranks must agree before the broadcast collective."""
    import torch.distributed as dist

    flag = [captured]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])
