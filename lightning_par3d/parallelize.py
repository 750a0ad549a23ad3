"""The one function that applies every parallelism, in a fixed order.

``parallelize(module, mesh, config, device)`` expects the model as ``configure_model`` left it: on the meta device
(or real on rank 0 with ``init="rank0"``). In order, it

1. checks the tensor-parallel plan against the model (patterns, divisibility, head counts) on every rank, before
   any data moves, so that a bad plan raises the same error everywhere instead of hanging a collective;
2. keeps rank 0's real weights aside and moves the model to meta;
3. applies tensor parallelism (``parallelize_module``) over the ``tp`` mesh;
4. applies FSDP2 ``fully_shard`` per block, then at the root, over the data-parallel mesh;
5. materializes each rank's shards on ``device`` and fills them from rank 0 (or with ``reset_parameters()``).

Under ``pp > 1`` the model's trunk is first split into this rank's stages (deep copies of the meta trunk that keep
only what each stage owns); 3 and 4 then run per stage, and the stages are grafted back into the trunk object at
their original names before 5 (:mod:`lightning_par3d.pipeline`). Activation checkpointing
(:mod:`lightning_par3d.activation_checkpoint`) runs between 3 and 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_par3d.activation_checkpoint import apply_activation_checkpointing
from lightning_par3d.compression import Compression
from lightning_par3d.config import Par3DConfig
from lightning_par3d.data_parallel import find_blocks, replicate_with_ddp, shard_data_parallel, uses_ddp, uses_fsdp
from lightning_par3d.materialize import capture_rank0_state, materialize, sync_rng_from_rank0
from lightning_par3d.mesh import Par3DMesh
from lightning_par3d.pipeline import build_schedule, declared_pipeline, install_loss, install_trunk
from lightning_par3d.pipeline_split import (
    V_SCHEDULES,
    balanced_split,
    build_stage_module,
    empty_holder,
    explicit_split,
    find_trunk_parts,
    graft,
    stage_indices,
)
from lightning_par3d.precision import fsdp_mixed_precision
from lightning_par3d.tensor_parallel import (
    apply_tensor_parallel,
    check_divisibility,
    expand_plan,
    find_plan,
    keep_grads_in_param_layout,
)


@dataclass(frozen=True)
class ParallelizeReport:
    """What :func:`parallelize` did, for the log line."""

    data_parallel: str
    tp_modules: int
    initialized_from: str
    pipeline: str = "none"
    activation_checkpointing: str = "none"

    def __str__(self) -> str:
        text = f"data parallel: {self.data_parallel}; tensor-parallel modules: {self.tp_modules}; "
        if self.pipeline != "none":
            text += f"pipeline: {self.pipeline}; "
        if self.activation_checkpointing != "none":
            text += f"activation checkpointing: {self.activation_checkpointing}; "
        return text + f"weights from {self.initialized_from}"


def parallelize(
    module: nn.Module, mesh: Par3DMesh, config: Par3DConfig, device: torch.device, precision: str = "32-true"
) -> tuple[nn.Module, ParallelizeReport]:
    """Applies pipeline, tensor and data parallelism to ``module`` and materializes it on ``device``.

    Returns the module to train: ``module`` itself (parallelized in place), or, for pure replication without
    tensor parallelism, ``module`` wrapped in ``DistributedDataParallel``. ``precision`` (Lightning's flag) sets
    FSDP2's mixed-precision policy.
    """
    import torch.distributed as dist

    layout = mesh.layout
    fqn_styles = checked_plan(module, config, layout.tp)
    if layout.pp > 1:
        return module, _parallelize_pipeline(module, mesh, config, device, fqn_styles, precision)
    blocks = find_blocks(module, config.fsdp_blocks) if layout.dp > 1 and layout.dp_shard > 1 else []

    state = capture_rank0_state(module, dist.get_rank())
    from_rank0 = _any_rank0(state.captured)

    apply_tensor_parallel(module, mesh["tp"], fqn_styles)
    checkpointed = apply_activation_checkpointing(
        module, config.activation_checkpointing, config.ac_blocks, config.ac_every
    )
    reshard = True if config.reshard_after_forward is None else config.reshard_after_forward
    shard_data_parallel(module, mesh, blocks, reshard, **_fsdp_policies(config, precision))
    _materialize(module, device, state, from_rank0, config.offload)
    if not uses_fsdp(mesh):
        keep_grads_in_param_layout(module)
    sync_rng_from_rank0()
    report = ParallelizeReport(
        data_parallel=_describe_data_parallel(mesh, len(blocks), config, precision),
        tp_modules=len(fqn_styles),
        initialized_from=_source(from_rank0),
        activation_checkpointing=_describe_ac(config, checkpointed),
    )
    if uses_ddp(mesh):
        return replicate_with_ddp(module, mesh, device, _compression(config)), report
    return module, report


def _fsdp_policies(config: Par3DConfig, precision: str) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    policies: dict[str, Any] = {"mp_policy": fsdp_mixed_precision(precision)}
    if config.offload:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return policies


def _materialize(
    module: nn.Module, device: torch.device, state: Any, from_rank0: bool, offload: bool, strict: bool = True
) -> None:
    """Allocates and fills the shards: on ``device``, or, with CPU offload, parameters on the CPU (where FSDP2's
    offload policy keeps them) and buffers on ``device``."""
    materialize(module, torch.device("cpu") if offload else device, state, source_is_rank0=from_rank0, strict=strict)
    if offload:
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf.to(device)


def _compression(config: Par3DConfig) -> Compression | None:
    if config.grad_compression is None:
        return None
    return Compression(config.grad_compression, config.powersgd_rank, config.powersgd_start_iter)


def checked_plan(module: nn.Module, config: Par3DConfig, tp: int) -> dict[str, str]:
    """The plan expanded over the whole model and checked, on every rank alike, before any data moves."""
    if tp == 1:
        return {}
    plan = find_plan(module, config.tp_plan)
    if not plan:
        raise ValueError(
            f"tp={tp} but {type(module).__name__} declares no tensor-parallel plan. Give the "
            "LightningModule a `tp_plan` attribute (module-name pattern → style), or set strategy.tp_plan."
        )
    fqn_styles = expand_plan(module, plan)
    check_divisibility(module, fqn_styles, tp)
    return fqn_styles


def _describe_ac(config: Par3DConfig, blocks: int) -> str:
    if config.activation_checkpointing == "none":
        return "none"
    every = f" (every {config.ac_every})" if config.activation_checkpointing == "selective" else ""
    return f"{config.activation_checkpointing}{every}, {blocks} blocks"


def _source(from_rank0: bool) -> str:
    return "rank 0 (broadcast)" if from_rank0 else "reset_parameters() on each rank"


def _parallelize_pipeline(
    module: nn.Module,
    mesh: Par3DMesh,
    config: Par3DConfig,
    device: torch.device,
    fqn_styles: dict[str, str],
    precision: str,
) -> ParallelizeReport:
    """Split → tensor parallel → FSDP2 per stage → materialize from rank 0 → schedule, as torchtitan orders them."""
    import torch.distributed as dist

    layout = mesh.layout
    trunk_attr, loss_attr = declared_pipeline(module)
    trunk = getattr(module, trunk_attr)
    _check_only_trunk_has_parameters(module, trunk_attr)
    parts = find_trunk_parts(trunk)
    v = 2 if config.pipeline_schedule in V_SCHEDULES else config.virtual_stages
    n_stages = layout.pp * v
    if len(parts.blocks) < n_stages:
        raise ValueError(
            f"Number of stages ({n_stages} = pp {layout.pp} × {v} per rank) cannot be greater than the number of "
            f"blocks ({len(parts.blocks)} in {trunk_attr}.{parts.container}). Reduce pp or virtual_stages, or use "
            "a deeper model."
        )
    split = (
        explicit_split(parts, config.split_points, n_stages)
        if config.split_points
        else balanced_split(trunk, parts, n_stages)
    )

    state = capture_rank0_state(module, dist.get_rank())
    from_rank0 = _any_rank0(state.captured)
    trunk = getattr(module, trunk_attr)  # now on meta
    indices = stage_indices(config.pipeline_schedule, mesh.coords(dist.get_rank()).pp, layout.pp, v)
    stage_modules = []
    reshard = False if config.reshard_after_forward is None else config.reshard_after_forward
    plan = find_plan(module, config.tp_plan) if fqn_styles else {}
    owned_by = {index: set(split[index]) for index in indices}
    checkpointed = 0
    for index in indices:
        stage = build_stage_module(trunk, parts, owned_by[index], index == 0, index == n_stages - 1)
        apply_tensor_parallel(stage, mesh["tp"], expand_plan(stage, plan, allow_missing=True) if plan else {})
        checkpointed += apply_activation_checkpointing(
            stage, config.activation_checkpointing, config.ac_blocks, config.ac_every
        )
        blocks = [stage.get_submodule(name) for name in parts.blocks if name in owned_by[index]]
        shard_data_parallel(
            stage, mesh, blocks if layout.dp_shard > 1 else [], reshard, **_fsdp_policies(config, precision)
        )
        stage_modules.append(stage)
    holder = empty_holder(trunk, parts)  # the trunk object itself, now holding nothing
    for index, stage in zip(indices, stage_modules, strict=True):
        graft(holder, stage, parts, owned_by[index], index == 0, index == n_stages - 1)
    install_trunk(module, trunk_attr, holder)
    _materialize(module, device, state, from_rank0, config.offload, strict=False)
    if not uses_fsdp(mesh):
        keep_grads_in_param_layout(module)
    sync_rng_from_rank0()
    runner = build_schedule(
        config.pipeline_schedule, stage_modules, mesh, config.microbatches, v, device, getattr(module, loss_attr)
    )
    install_loss(module, loss_attr, runner)
    return ParallelizeReport(
        data_parallel=_describe_data_parallel(mesh, sum(len(split[i]) for i in indices), config, precision),
        tp_modules=len(fqn_styles),
        initialized_from=_source(from_rank0),
        pipeline=f"{config.pipeline_schedule}, stages {indices} of {n_stages}, {config.microbatches} microbatches",
        activation_checkpointing=_describe_ac(config, checkpointed),
    )


def _check_only_trunk_has_parameters(module: nn.Module, trunk_attr: str) -> None:
    outside = [n for n, _ in module.named_parameters() if not n.startswith(trunk_attr + ".")]
    if outside:
        raise TypeError(
            f"Under pp > 1 every parameter must live in the pipelined trunk {type(module).__name__}.{trunk_attr}; "
            f"these do not: {', '.join(outside[:5])}. Move them into the trunk."
        )


def _describe_data_parallel(mesh: Par3DMesh, blocks: int, config: Par3DConfig, precision: str) -> str:
    layout = mesh.layout
    if layout.dp == 1:
        return "none"
    if uses_ddp(mesh):
        compressed = f", {config.grad_compression} gradient compression" if config.grad_compression else ""
        return f"DDP over {layout.dp} replicas (ZeRO-0{compressed})"
    if layout.dp_shard == 1:
        return f"FSDP2 replicated over {layout.dp} ranks (ZeRO-0, one unit)"
    replicas = f" × {layout.dp_replicate} replicas" if layout.dp_replicate > 1 else ""
    if layout.zero in (1, 2):
        what = "optimizer state" if layout.zero == 1 else "optimizer state and gradients"
        return f"ZeRO-{layout.zero}: {what} sharded over dp_shard={layout.dp_shard}{replicas}"
    kind = "HSDP" if layout.dp_replicate > 1 else "FSDP2"
    extras = [f"{precision} gathers" if precision.endswith("-mixed") else "", "CPU offload" if config.offload else ""]
    detail = "".join(f", {e}" for e in extras if e)
    return f"ZeRO-3 with {kind} ({blocks} blocks + root{detail})"


def _any_rank0(captured: bool) -> bool:
    """Whether rank 0 captured real weights; all ranks must agree before the broadcast collective."""
    import torch.distributed as dist

    flag = [captured]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])
