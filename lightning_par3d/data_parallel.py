"""Data parallelism with FSDP2 ``fully_shard``: full shard, HSDP, or plain replication, chosen by the mesh.

=========================  ==================  ===================================================================
dp_replicate × dp_shard    FSDP2 mesh          what each rank holds at rest
=========================  ==================  ===================================================================
1 × N                      1D ``dp_shard``     1/N of parameters, gradients, optimizer state (ZeRO-3)
R × N                      2D HSDP             1/N, replicated over R; gradients reduce-scattered then all-reduced
R × 1, with tp > 1         2D, shard size 1    everything replicated; one FSDP2 unit, one gradient all-reduce
R × 1, tp = 1              torch DDP           everything replicated; bucketed all-reduce overlapping backward
=========================  ==================  ===================================================================

Pure replication without tensor parallelism uses ``DistributedDataParallel`` itself: parameters stay plain tensors,
so the optimizer runs without DTensor dispatch, and gradients go out in DDP's buckets during backward. Measured on
the example GPT at dp=4 on CPU, FSDP2 with a shard size of 1 took 1.9–2.9× DDP's step time (see the README's
benchmark). DDP cannot hold DTensor parameters, so with tp > 1 replication stays on FSDP2, as one root unit.

Blocks are wrapped one by one before the root so that each block's all-gather overlaps the previous block's
compute and its gathered parameters are freed after use. The root is the LightningModule itself; its step methods
(``training_step`` …) are registered as FSDP forward methods, because Lightning calls those, not ``forward``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_par3d.patterns import find_modules, repeated_members

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_par3d.mesh import Par3DMesh

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def find_blocks(module: nn.Module, pattern: str | None) -> list[nn.Module]:
    """The modules FSDP2 wraps before the root: those ``pattern`` matches, else the members of every
    ``nn.ModuleList`` / ``nn.ModuleDict`` of repeated same-typed blocks. A pattern that matches nothing is an
    error."""
    if pattern is not None:
        found = [sub for _, sub in find_modules(module, pattern)]
        if not found:
            raise ValueError(
                f"fsdp_blocks={pattern!r} matches no module of {type(module).__name__}. Use a module-name pattern "
                "such as 'transformer.h.*', or leave it unset to wrap each element of the model's ModuleLists."
            )
        return found
    return [block for sub in module.modules() for block in repeated_members(sub)]


def fsdp_mesh(mesh: Par3DMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1D ``dp_shard`` without replicas, else 2D ``(dp_replicate, dp_shard)``."""
    return mesh["dp_shard"] if mesh.layout.dp_replicate == 1 else mesh["fsdp"]


def shard_data_parallel(
    module: nn.Module, mesh: Par3DMesh, blocks: list[nn.Module], reshard_after_forward: bool = True
) -> None:
    """Applies ``fully_shard`` to each block, then to ``module`` as the root. Does nothing when dp = 1.

    Run it after tensor parallelism and on the meta device: FSDP2 shards the (possibly DTensor) parameters over the
    data-parallel mesh without moving data.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if mesh.layout.dp == 1 or uses_ddp(mesh):
        return
    dp_mesh = fsdp_mesh(mesh)
    if mesh.layout.dp_shard == 1:
        # Pure replication: nothing to gather, so one unit at the root gives DDP's single flat all-reduce instead
        # of one all-reduce (and one copy in and out) per block.
        blocks, reshard_after_forward = [], False
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    for name in STEP_METHODS:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)


def uses_ddp(mesh: Par3DMesh) -> bool:
    """Whether the layout is pure replication without tensor parallelism, which :func:`replicate_with_ddp` serves."""
    layout = mesh.layout
    return layout.dp_replicate > 1 and layout.dp_shard == 1 and layout.tp == 1 and layout.pp == 1


def replicate_with_ddp(module: nn.Module, mesh: Par3DMesh, device: torch.device) -> DistributedDataParallel:
    """Wraps the materialized ``module`` in ``DistributedDataParallel`` over the data-parallel group."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=mesh["dp"].get_group())


@contextmanager
def no_gradient_sync(module: nn.Module) -> Iterator[None]:
    """Skips the gradient reduction of the backward passes inside (the non-final batches of gradient accumulation):
    DDP's ``no_sync()``, or FSDP2's ``set_requires_gradient_sync(False)``."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
        return
    fsdp = module if isinstance(module, FSDPModule) else None
    if fsdp is not None:
        fsdp.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        if fsdp is not None:
            fsdp.set_requires_gradient_sync(True)
