"""The one function that applies every parallelism, in a fixed order.

``parallelize(module, mesh, config, device)`` expects the model as its builder left it: on the meta device (or
real on rank 0 with ``init="rank0"``). In order, it

1. checks the tensor-parallel plan against the whole model (patterns, divisibility, head counts) on every rank,
   before any data moves, so that a bad plan raises the same error everywhere instead of hanging a collective;
2. under ``pp > 1``, plans the stages (which blocks each stage owns);
3. keeps rank 0's real weights aside and moves the model to meta;
4. applies, per part, :func:`parallelize_part`: tensor parallelism (``parallelize_module``) over the ``tp`` mesh,
   then activation checkpointing, then ``torch.compile`` per block (``compile=True``), then FSDP2 ``fully_shard``
   per block and at the part's root. The part is the
   whole model, or, under ``pp > 1``, each of this rank's stages: deep copies of the meta trunk that keep only what
   the stage owns, grafted back into the trunk object at their original names afterwards (torchtitan splits, then
   calls one function per part, in the same way);
5. materializes each rank's shards on ``device`` and fills them from rank 0 (or with ``reset_parameters()``);
   torchmetrics metrics are kept out of 3–5 and put back with their states
   (:mod:`lightning_par3d.parallel.metric_state`);
6. wraps pure replication in ``DistributedDataParallel``, and under ``pp > 1`` builds the pipeline runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par3d.checkpoint.peft_files import adapters_of, init_fresh_adapters
from lightning_par3d.checkpoint.pretrained import load_pretrained, pretrained_path
from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.parallel.activation_checkpoint import apply_activation_checkpointing
from lightning_par3d.parallel.compile import compile_blocks, is_compiled, training_without_kv_cache
from lightning_par3d.parallel.compression import compression_of
from lightning_par3d.parallel.context_parallel import apply_context_parallel
from lightning_par3d.parallel.context_pipeline import apply_stage_context_parallel
from lightning_par3d.parallel.data_parallel import find_blocks, replicate_with_ddp, shard_data_parallel
from lightning_par3d.parallel.expert_parallel import ExpertSpec, apply_expert_parallel, find_experts
from lightning_par3d.parallel.lora_plan import adapter_plan
from lightning_par3d.parallel.materialize import BuildState, capture_rank0_state, materialize, sync_rng_from_rank0
from lightning_par3d.parallel.metric_state import detach_metrics, metrics_in, reattach_metrics, snapshot
from lightning_par3d.parallel.precision import fsdp_mixed_precision
from lightning_par3d.parallel.sequence_parallel import sequence_parallel_plan
from lightning_par3d.parallel.tensor_parallel import (
    apply_tensor_parallel,
    check_divisibility,
    expand_plan,
    find_plan,
    keep_grads_in_param_layout,
    plan_tied_weights,
)
from lightning_par3d.parallel.ties import retie, tied_groups
from lightning_par3d.pipeline.runner import PipelineRunner, build_runner
from lightning_par3d.pipeline.split import NotOnThisStage, StagePlan, empty_holder, plan_stages
from lightning_par3d.pipeline.transformers_stages import check_pipelinable, decoder_layout, install_stage_forward
from lightning_par3d.pipeline.trunk import check_only_trunk_has_parameters, declared_pipeline, install_trunk

if TYPE_CHECKING:
    from lightning_par3d.pipeline.trunk import PipelineSpec


@dataclass(frozen=True)
class ParallelizeReport:
    """What :func:`parallelize` did, for the log line."""

    data_parallel: str
    tp_modules: int
    initialized_from: str
    pipeline: str = "none"
    activation_checkpointing: str = "none"
    compiled: str = "none"
    sequence_parallel: bool = False
    expert_parallel: str = "none"

    def __str__(self) -> str:
        text = f"data parallel: {self.data_parallel}; tensor-parallel modules: {self.tp_modules}; "
        if self.sequence_parallel:
            text += "sequence parallel (the residual stream split over tp); "
        if self.expert_parallel != "none":
            text += f"expert parallel: {self.expert_parallel}; "
        if self.pipeline != "none":
            text += f"pipeline: {self.pipeline}; "
        if self.activation_checkpointing != "none":
            text += f"activation checkpointing: {self.activation_checkpointing}; "
        if self.compiled != "none":
            text += f"torch.compile: {self.compiled}; "
        return text + f"weights from {self.initialized_from}"


@dataclass
class ParallelizeResult:
    """What :func:`parallelize` returns: the module to train, the pipeline runner under pp, and the report."""

    forward_module: nn.Module
    """The module itself (parallelized in place), or, for pure replication, ``DistributedDataParallel`` over it."""
    pipeline: PipelineRunner | None
    spec: PipelineSpec | None
    report: ParallelizeReport


def parallelize(
    module: nn.Module, mesh: Par3DMesh, config: Par3DConfig, device: torch.device, precision: str = "32-true"
) -> ParallelizeResult:
    """Applies pipeline, tensor and data parallelism to ``module`` in place and materializes it on ``device``.

    ``precision`` (Lightning's ``precision=`` names) sets FSDP2's mixed-precision policy. Every rank must call it:
    it moves weights from rank 0 with collectives.
    """
    layout = mesh.layout
    fqn_styles = checked_plan(module, config, layout.tp)
    experts = find_experts(module, layout.ep) if layout.ep > 1 else None
    spec = declared_pipeline(module) if layout.pp > 1 else None
    stage_plan = plan_pipeline(module, spec, config, layout) if spec is not None else None
    blocks = fsdp_blocks(module, config, layout) if spec is None else []

    if layout.cp > 1 and spec is None:  # hooks on the trunk and its blocks, before checkpointing wraps them
        rank = dist.get_rank()
        apply_context_parallel(module, find_blocks(module, config.fsdp_blocks), mesh.cp_group, mesh.cp_rank(rank),
                               layout.cp, config.ignore_index)  # fmt: skip
    cache_off = training_without_kv_cache(module) if config.compile else []
    metrics = detach_metrics(module)  # torchmetrics states would not survive meta and to_empty
    metric_shots = _rank0_metric_states(metrics)
    state = capture_rank0_state(module, dist.get_rank())
    from_rank0 = _any_rank0(state.captured, device)
    if spec is None or stage_plan is None:
        checkpointed = parallelize_part(module, mesh, config, precision, fqn_styles, blocks, experts=experts)
        stage_modules: list[nn.Module] = []
        n_blocks = len(blocks)
    else:
        stage_modules, checkpointed = _parallelize_stages(
            module, spec, stage_plan, mesh, config, precision, fqn_styles, experts
        )
        n_blocks = sum(len(stage_plan.blocks[i]) for i in layout.stage_indices(mesh.coords(dist.get_rank()).pp))
    source = "rank0" if from_rank0 else ("none" if config.init == "pretrained" else "reset")
    _materialize(module, device, state, source, config.offload, strict=spec is None)
    if source == "reset":  # LoRA adapters as peft starts them (lora_B zero), not as nn.Linear's reset
        init_fresh_adapters(module)
    if config.init == "pretrained":
        load_pretrained(module, pretrained_path(module, config.pretrained_path), config.adapter_path)
    reattach_metrics(metrics, device, metric_shots, precision)
    if layout.data_parallel != "fsdp":
        keep_grads_in_param_layout(module)
    sync_rng_from_rank0()
    report = ParallelizeReport(
        data_parallel=_describe_data_parallel(mesh, n_blocks, config, precision),
        tp_modules=len(fqn_styles),
        initialized_from=_source(source, config.pretrained_path, config.adapter_path if adapters_of(module) else ""),
        pipeline=_describe_pipeline(mesh, config) if spec is not None else "none",
        activation_checkpointing=_describe_ac(config, checkpointed),
        compiled=_describe_compile(module, config, cache_off),
        sequence_parallel=any(style == "sequence_shard" for style in fqn_styles.values()),
        expert_parallel=_describe_experts(experts, layout) if experts is not None else "none",
    )
    runner = build_runner(stage_modules, mesh, device) if stage_modules else None
    forward_module = (
        replicate_with_ddp(module, mesh, device, compression_of(config)) if layout.data_parallel == "ddp" else module
    )
    return ParallelizeResult(forward_module, runner, spec, report)


def parallelize_part(
    part: nn.Module,
    mesh: Par3DMesh,
    config: Par3DConfig,
    precision: str,
    fqn_styles: dict[str, str],
    blocks: list[nn.Module],
    stage_blocks: tuple[list[nn.Module], int] | None = None,
    experts: ExpertSpec | None = None,
) -> int:
    """Tensor parallel → activation checkpointing → ``torch.compile`` per block (``compile=True``) → FSDP2 (per
    block in ``blocks``, then ``part`` as the root), on the meta device; returns how many blocks are checkpointed.
    The same function serves the whole model and each stage (``stage_blocks``: the stage's blocks, and the first's
    position in the model, which checkpointing and compilation take instead of searching for containers of repeated
    blocks), and the memory estimator (:mod:`lightning_par3d.memory.estimate`), which calls it on fake tensors over
    torch's fake process group (with ``compile=False``: it measures the eager build), so that its estimate is of
    this very build. ``experts`` (under ``ep > 1``): the model's experts, split over ``ep`` after tensor parallelism
    and sharded by FSDP2 over the ranks that hold the same ones."""
    own, first_index = stage_blocks if stage_blocks is not None else (None, 0)
    ties = tied_groups(part) if fqn_styles else []
    apply_tensor_parallel(part, mesh["tp"], fqn_styles)
    retie(part, ties)
    if experts is not None:
        apply_expert_parallel(part, experts, mesh)
    checkpointed = apply_activation_checkpointing(
        part, config.activation_checkpointing, config.ac_blocks, config.ac_every, own, first_index
    )
    if config.compile:
        compile_blocks(part, config.compile_options, own)
    policies = _fsdp_policies(config, precision)
    shard_data_parallel(part, mesh, blocks, mesh.layout.reshard_after_forward, experts=experts, **policies)
    return checkpointed


def fsdp_blocks(module: nn.Module, config: Par3DConfig, layout: Layout) -> list[nn.Module]:
    """The blocks of the whole model that FSDP2 wraps one by one before the root (none unless dp_shard × cp > 1)."""
    return find_blocks(module, config.fsdp_blocks) if layout.shard_ranks > 1 else []


def plan_pipeline(module: nn.Module, spec: PipelineSpec, config: Par3DConfig, layout: Layout) -> StagePlan:
    """Which blocks each pipeline stage owns, after checking that only the trunk holds parameters and that the
    trunk can be pipelined."""
    check_only_trunk_has_parameters(module, spec.trunk)
    trunk = getattr(module, spec.trunk)
    check_pipelinable(trunk)
    where = f"{type(module).__name__}.{spec.trunk}"
    return plan_stages(trunk, layout.pp, layout.stages_per_rank, config.split_points, where)


def _parallelize_stages(
    module: nn.Module,
    spec: PipelineSpec,
    plan: StagePlan,
    mesh: Par3DMesh,
    config: Par3DConfig,
    precision: str,
    fqn_styles: dict[str, str],
    experts: ExpertSpec | None = None,
) -> tuple[list[nn.Module], int]:
    """This rank's stages, each parallelized by :func:`parallelize_part` with its share of the whole model's plan
    (``fqn_styles``, full names in ``module``) and grafted back into the (emptied) trunk object at their original
    names."""
    layout = mesh.layout
    trunk = getattr(module, spec.trunk)  # on meta by now
    indices = layout.stage_indices(mesh.coords(dist.get_rank()).pp)
    stages, checkpointed = [], 0
    for index in indices:
        stage = build_stage(trunk, plan, index, layout.n_stages, sequence_shards(config, layout))
        checkpointed += parallelize_stage(stage, plan, index, mesh, config, precision, fqn_styles, spec.trunk, experts)
        stages.append(stage)
    holder = empty_holder(trunk, plan.parts)  # the trunk object itself, now holding nothing
    for index, stage in zip(indices, stages, strict=True):
        plan.graft(holder, stage, index)
    install_trunk(module, spec.trunk, holder)
    return stages, checkpointed


def sequence_shards(config: Par3DConfig, layout: Layout) -> int:
    """How many sequence shards the hidden states between pipeline stages are split into (tp under
    ``sequence_parallel=True``, else 1)."""
    return layout.tp if config.sequence_parallel and layout.tp > 1 else 1


def build_stage(trunk: nn.Module, plan: StagePlan, index: int, n_stages: int, shards: int = 1) -> nn.Module:
    """Stage ``index`` of ``trunk``: a deep copy that keeps only what the stage owns (:meth:`StagePlan.build`),
    and, for a transformers decoder, runs its own part of the model's forward (``shards``: the sequence shards a
    later stage receives, :func:`sequence_shards`)."""
    stage = plan.build(trunk, index)
    decoder = decoder_layout(trunk)
    if decoder is not None:
        layer_numbers = [int(name.rsplit(".", 1)[1]) for name in plan.blocks[index]]
        install_stage_forward(stage, decoder, layer_numbers, index == 0, index == n_stages - 1, shards)
    return stage


def parallelize_stage(
    stage: nn.Module,
    plan: StagePlan,
    index: int,
    mesh: Par3DMesh,
    config: Par3DConfig,
    precision: str,
    fqn_styles: dict[str, str],
    trunk_attr: str,
    experts: ExpertSpec | None = None,
) -> int:
    """:func:`parallelize_part` on stage ``index`` (built by :func:`build_stage`), with its share of the whole
    model's plan, and its blocks (one, or more) as the blocks to checkpoint and compile and as FSDP2's units; returns
    how many blocks are checkpointed."""
    styles = stage_styles(fqn_styles, stage, trunk_attr)
    own = [stage.get_submodule(name) for name in plan.blocks[index]]
    if mesh.layout.cp > 1:  # each microbatch's rows sliced at the stage, before checkpointing wraps its blocks
        cp_rank = mesh.cp_rank(dist.get_rank())
        apply_stage_context_parallel(stage, own, mesh.cp_group, cp_rank, mesh.layout.cp, config.ignore_index)
    first_index = sum(len(names) for names in plan.blocks[:index])
    units = own if mesh.layout.shard_ranks > 1 else []
    return parallelize_part(stage, mesh, config, precision, styles, units, (own, first_index), experts=experts)


def stage_styles(fqn_styles: dict[str, str], stage: nn.Module, trunk_attr: str) -> dict[str, str]:
    """The entries of the whole model's plan (``fqn_styles``, full names in the LightningModule, as
    :func:`checked_plan` expands them) whose module is on ``stage``, by their names within the stage.

    A module another stage holds is absent from ``stage`` or a parameterless :class:`NotOnThisStage` placeholder;
    its entry is skipped here (the LM head's on the first stage, the embedding's on the last), never applied to the
    placeholder. A pattern that matches nothing on any stage was already refused by :func:`checked_plan`."""
    prefix = f"{trunk_attr}."
    styles = {
        name: fqn_styles[prefix + name]
        for name, sub in stage.named_modules()
        if name and prefix + name in fqn_styles and not isinstance(sub, NotOnThisStage)
    }
    params = {  # entries naming a parameter (experts.gate_up_proj), where the stage holds the module they split
        name[len(prefix) :]: style
        for name, style in fqn_styles.items()
        if name.startswith(prefix) and name[len(prefix) :].rpartition(".")[0] in styles
        and name[len(prefix) :] not in styles
    }  # fmt: skip
    return {**styles, **params}


def _fsdp_policies(config: Par3DConfig, precision: str) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    policies: dict[str, Any] = {"mp_policy": fsdp_mixed_precision(precision)}
    if config.offload:
        policies["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return policies


def _materialize(
    module: nn.Module, device: torch.device, state: BuildState, source: str, offload: bool, strict: bool = True
) -> None:
    """Allocates and fills the shards: on ``device``, or, with CPU offload, parameters on the CPU (where FSDP2's
    offload policy keeps them) and buffers on ``device``. ``strict=False`` under pipelining: each rank holds only
    its stages' entries of rank 0's full state dict."""
    materialize(module, torch.device("cpu") if offload else device, state, source, strict=strict)
    if offload:
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf.to(device)


def checked_plan(module: nn.Module, config: Par3DConfig, tp: int) -> dict[str, str]:
    """The plan expanded over the whole model and checked, on every rank alike, before any data moves."""
    if tp == 1:
        return {}
    plan = find_plan(module, config.tp_plan)
    if not plan:
        raise ValueError(
            f"tp={tp} but {type(module).__name__} declares no tensor-parallel plan. Give the "
            "model a `tp_plan` attribute (module-name pattern → style), or set the config's tp_plan."
        )
    fqn_styles = plan_tied_weights(module, expand_plan(module, plan))
    if config.sequence_parallel:
        fqn_styles = sequence_parallel_plan(module, fqn_styles)
    fqn_styles = adapter_plan(module, fqn_styles)  # LoRA layers: the base layer split, the adapters to match
    check_divisibility(module, fqn_styles, tp)
    return fqn_styles


def _describe_experts(experts: ExpertSpec, layout: Layout) -> str:
    shard = f", FSDP2 over the {layout.expert_shard} ranks holding the same ones" if layout.expert_shard > 1 else ""
    return (
        f"ep={layout.ep}, {experts.num_experts // layout.ep} of {experts.num_experts} experts per rank in "
        f"{len(experts.names)} layers (tokens by all-to-all){shard}"
    )


def _describe_ac(config: Par3DConfig, blocks: int) -> str:
    if config.activation_checkpointing == "none":
        return "none"
    every = f" (every {config.ac_every})" if config.activation_checkpointing == "selective" else ""
    return f"{config.activation_checkpointing}{every}, {blocks} blocks"


def _describe_compile(module: nn.Module, config: Par3DConfig, cache_off: list[str]) -> str:
    if not config.compile:
        return "none"
    blocks = sum(is_compiled(sub) for sub in module.modules())
    options = ", ".join(f"{k}={v!r}" for k, v in sorted(config.compile_options.items()))
    text = f"{blocks} blocks in place" + (f" ({options})" if options else "")
    if cache_off:
        text += f", KV cache off in training ({', '.join(cache_off)}.config.use_cache=False)"
    return text


def _describe_pipeline(mesh: Par3DMesh, config: Par3DConfig) -> str:
    layout = mesh.layout
    indices = layout.stage_indices(mesh.coords(dist.get_rank()).pp)
    return f"{layout.schedule}, stages {indices} of {layout.n_stages}, {layout.microbatches} microbatches"


def _source(source: str, path: str | None, adapters: str | None = "") -> str:
    """Where the weights came from; ``adapters``: a peft model's saved adapters' directory, None for fresh ones,
    ``""`` without adapters."""
    if source == "none":
        text = f"the pretrained checkpoint {path or '(from the model config)'}, each rank reading its slices"
        if adapters is None:
            return text + "; fresh LoRA adapters (lora_B zero)"
        return text + (f"; the adapters from {adapters}" if adapters else "")
    return "rank 0 (broadcast)" if source == "rank0" else "reset_parameters() on each rank"


def _describe_data_parallel(mesh: Par3DMesh, blocks: int, config: Par3DConfig, precision: str) -> str:
    layout = mesh.layout
    kind = layout.data_parallel
    replicas = f" × {layout.dp_replicate} replicas" if layout.dp_replicate > 1 else ""
    if kind == "none":
        return "none"
    if kind == "ddp":
        compressed = f", {config.grad_compression} gradient compression" if config.grad_compression else ""
        return f"DDP over {layout.dp} replicas (ZeRO-0{compressed})"
    if kind == "zero":
        what = "optimizer state" if layout.zero == 1 else "optimizer state and gradients"
        return f"ZeRO-{layout.zero}: {what} sharded over dp_shard={layout.dp_shard}{replicas}"
    if layout.shard_ranks == 1:
        return f"FSDP2 replicated over {layout.dp} ranks (ZeRO-0, one unit)"
    sharding = "HSDP" if layout.dp_replicate > 1 else "FSDP2"
    extras = [f"{precision} gathers" if precision.endswith("-mixed") else "", "CPU offload" if config.offload else ""]
    detail = "".join(f", {e}" for e in extras if e)
    over = f" over dp_shard × cp = {layout.shard_ranks} ranks" if layout.cp > 1 else ""
    return f"ZeRO-3 with {sharding}{over} ({blocks} blocks + root{detail})"


def _rank0_metric_states(detached: list[Any]) -> list[Any]:
    """Rank 0's torchmetrics states, on every rank (for metrics another rank built on the meta device)."""
    metrics = metrics_in(detached)
    if not metrics:
        return []
    box: list[Any] = [snapshot(metrics)]  # every rank's own, so that a dry run's rank (which hears none) has one
    dist.broadcast_object_list(box, src=0)
    return list(box[0])


def _any_rank0(captured: bool, device: torch.device) -> bool:
    """Whether rank 0 captured real weights; all ranks must agree before the broadcast collective."""
    flag = torch.tensor([int(captured)], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
