"""Data parallelism, chosen by the mesh and the ZeRO stage: FSDP2 ``fully_shard`` (full shard, HSDP, replication
with tp) or torch DDP.

=========================  =====  ==================  ==============================================================
dp_replicate × dp_shard    stage  engine              what each rank holds at rest
=========================  =====  ==================  ==============================================================
1 × N                      3      FSDP2, 1D mesh      1/N of parameters, gradients, optimizer state
R × N                      3      FSDP2, 2D (HSDP)    1/N, replicated over R; reduce-scatter then all-reduce
R × N                      1, 2   none here           whole parameters; :mod:`lightning_par3d.zero` shards the rest
R × 1, with tp > 1         0      FSDP2, shard 1      everything replicated; one FSDP2 unit, one all-reduce
R × 1, tp = 1              0      torch DDP           everything replicated; bucketed all-reduce during backward
=========================  =====  ==================  ==============================================================

Pure replication without tensor parallelism uses ``DistributedDataParallel`` itself: parameters stay plain tensors,
so the optimizer runs without DTensor dispatch, and gradients go out in DDP's buckets during backward. Measured on
the example GPT at dp=4 on CPU, FSDP2 with a shard size of 1 took 1.9–2.9× DDP's step time (see docs/benchmarks.md's
benchmark). DDP cannot hold DTensor parameters, so with tp > 1 replication stays on FSDP2, as one root unit.

Blocks are wrapped one by one before the root so that each block's all-gather overlaps the previous block's
compute and its gathered parameters are freed after use. The root is the LightningModule itself; its step methods
(``training_step`` …) are registered as FSDP forward methods, because Lightning calls those, not ``forward``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_par3d.parallel.compression import Compression
from lightning_par3d.parallel.expert_parallel import ExpertSpec, shard_experts
from lightning_par3d.parallel.packed_shards import fsdp_shard_placement
from lightning_par3d.utils.patterns import find_modules, repeated_members

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from lightning_par3d.distributed.mesh import Par3DMesh

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
    module: nn.Module,
    mesh: Par3DMesh,
    blocks: list[nn.Module],
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    experts: ExpertSpec | None = None,
) -> None:
    """Applies ``fully_shard`` to each block, then to ``module`` as the root, where FSDP2 serves the layout's
    data-parallel dimension (``layout.data_parallel == "fsdp"``). Does nothing when dp = 1, under DDP, and for ZeRO
    stages 1 and 2 (parameters stay whole; :class:`~lightning_par3d.zero.optimizer.ZeroOptimizer` shards).

    Run it after tensor parallelism and on the meta device: FSDP2 shards the (possibly DTensor) parameters over the
    data-parallel mesh without moving data. ``mp_policy`` sets the dtype of the gathered parameters and of the
    gradient reduction; ``offload_policy`` keeps the shards in CPU memory. A packed projection's interleaved
    shards are sharded on another dim (:func:`~lightning_par3d.parallel.packed_shards.fsdp_shard_placement`).
    Under expert parallelism (``experts``), each module of experts is its own unit first, on the ranks that hold the
    same experts (:func:`~lightning_par3d.parallel.expert_parallel.shard_experts`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

    if mesh.layout.data_parallel != "fsdp":
        return
    dp_mesh = fsdp_mesh(mesh)
    if mesh.layout.shard_ranks == 1:
        # Pure replication: nothing to gather, so one unit at the root gives DDP's single flat all-reduce instead
        # of one all-reduce (and one copy in and out) per block.
        blocks, reshard_after_forward = [], False
    mp, offload = mp_policy or MixedPrecisionPolicy(), offload_policy or OffloadPolicy()
    if experts is not None:
        shard_experts(
            module, experts, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload
        )
    for unit in (*blocks, module):
        fully_shard(
            unit,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp,
            offload_policy=offload,
            shard_placement_fn=fsdp_shard_placement,
        )
    for name in STEP_METHODS:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    if mesh.layout.tp > 1:
        quiet_view_warning(type(module).__name__)  # FSDP2's class by now: FSDP<Class>


def quiet_view_warning(root_class: str) -> None:
    """Silences FSDP2's "returned a view tensor" warning for the root of class ``root_class`` (FSDP2's
    ``FSDP<Class>``; once per rank otherwise) under tensor parallelism, where it cannot mean a wrong gradient.

    FSDP2 warns when an FSDP module returns a view, because an in-place op on a view drops its pre-backward hook.
    Under tp the root returns one: a tensor-parallel module's output (the LM head's gathered logits) is
    ``DTensor.to_local()``, a view made inside a custom autograd ``Function``. An in-place op on such a view is
    refused by autograd itself ("Output 0 of _ToTorchTensor is a view and is being modified inplace … This behavior
    is forbidden"; ``tests/test_tensor_parallel.py`` shows it), so the hook can never be dropped silently; and the
    root keeps its parameters gathered from forward to backward in any case. A block's or a user's own view still
    warns."""
    import warnings

    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({re.escape(root_class)}\) returned a view")


def replicate_with_ddp(
    module: nn.Module, mesh: Par3DMesh, device: torch.device, compression: Compression | None = None
) -> DistributedDataParallel:
    """Wraps the materialized ``module`` in ``DistributedDataParallel`` over the data-parallel group, with the
    gradient compression hook of ``compression`` if one is given."""
    device_ids = [device.index] if device.type == "cuda" else None
    # Gradients as views into DDP's all-reduce buckets: one copy of the gradients, not two.
    ddp = DistributedDataParallel(
        module, device_ids=device_ids, process_group=mesh["dp"].get_group(), gradient_as_bucket_view=True
    )
    if compression is not None:
        compression.register(ddp, mesh["dp"].get_group())
    return ddp


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
