"""The memory estimator: per-rank bytes of a layout, before launch, with no real allocation.

:func:`estimate_memory` builds the model under ``FakeTensorMode`` (tensors with shapes, dtypes and devices, but no
storage) and, for each pipeline stage, builds and parallelizes it with the run's own functions, in a single process
over torch's fake process group (collectives that move nothing): the mesh (:meth:`Par3DMesh.build`), the checked
tensor-parallel plan, the stage split (:func:`~lightning_par3d.compose.plan_pipeline`,
:func:`~lightning_par3d.compose.build_stage`) and
:func:`~lightning_par3d.compose.parallelize_part` itself: tensor parallelism, activation checkpointing
and FSDP2's ``fully_shard`` with the run's mixed-precision policy. A change to the build changes the estimate with
it. From that it takes

* **model state** from each rank's local parameter shapes through the ZeRO formulas
  (:mod:`lightning_par3d.zero.formula`), for the data-parallel stage, precision and optimizer;
* **activations** by running one microbatch forward through the rank's stage(s) and counting what autograd saves
  for backward (:class:`~lightning_par3d.memory.meters.SavedTensorMeter`), times the microbatches the pipeline schedule
  keeps in flight, found by walking torch's own schedule (its ``pipeline_order``: ``F`` adds a microbatch, ``B``
  or ``W`` releases it).

Under activation checkpointing the activations are what is held between forward and backward (the checkpointed
blocks' inputs, or what ``op`` mode saves); the block that backward recomputes at a time is its own column,
``recompute``, counted in the total.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par3d import compose as build
from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.distributed.fakeworld import fake_world, garbage_kept
from lightning_par3d.distributed.groups import fake_group
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.memory.meters import ModelStateBytes, SavedTensorMeter
from lightning_par3d.parallel.activation_checkpoint import find_ac_blocks
from lightning_par3d.parallel.precision import autocast, check_precision
from lightning_par3d.parallel.tensor_parallel import local_tensor
from lightning_par3d.pipeline.actions import Action, pipeline_actions, schedule_peak
from lightning_par3d.pipeline.trunk import declared_pipeline
from lightning_par3d.utils.torch_private import fake_mode_paused, fake_tensor_mode, moves_in_place_skipped
from lightning_par3d.zero.formula import OPTIMIZER_STATE_LAYOUTS, model_state_formula

_DTYPE_BYTES = {"32-true": (4, 4, 4), "bf16-mixed": (4, 4, 4), "16-mixed": (4, 4, 4), "bf16-true": (2, 2, 2)}
"""(parameter, gradient, optimizer state) element bytes per precision: the ``-mixed`` modes keep fp32 masters."""


@dataclass(frozen=True)
class RankEstimate:
    """The estimate for the ranks at one pipeline position (every dp and tp rank there is alike, up to padding;
    the figures are those of dp_shard rank 0, which holds the most)."""

    pp_rank: int
    stages: tuple[int, ...]
    ranks: tuple[int, ...]
    state: ModelStateBytes
    activations: int
    """Peak bytes held for backward: the microbatches in flight times each stage's bytes per microbatch."""
    recompute: int
    """Under full or selective checkpointing, the largest block's activations, rebuilt during backward on top."""
    activations_per_microbatch: tuple[int, ...]
    in_flight: int
    """Peak number of (stage, microbatch) activations held at once on this rank."""

    @property
    def total(self) -> int:
        return self.state.total + self.activations + self.recompute


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes for one layout; ``str()`` gives the table."""

    layout: Layout
    precision: str
    activation_checkpointing: str
    microbatch_shape: tuple[int, ...]
    rows: list[RankEstimate] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """The most any rank needs."""
        return max(row.total for row in self.rows)

    def __str__(self) -> str:
        return format_estimate(self)


def _unit(peak: int) -> tuple[str, int]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20)):
        if peak >= size:
            return name, size
    return "KiB", 2**10


def format_estimate(estimate: MemoryEstimate) -> str:
    """A readable per-rank table, in the unit that suits the peak (KiB, MiB or GiB)."""
    unit, size = _unit(estimate.peak)

    def fmt(n: int) -> str:
        return f"{n / size:,.1f}"

    layout = estimate.layout
    head = (
        f"par3d memory estimate: {layout}, ZeRO-{layout.zero}, {estimate.precision}, activation checkpointing "
        f"{estimate.activation_checkpointing}, microbatch {tuple(estimate.microbatch_shape)}"
    )
    columns = (
        "pp rank",
        "stages",
        "ranks",
        "params",
        "grads",
        "optimizer",
        "activations",
        "in flight",
        "recompute",
        "total",
    )
    lines = [head, "", "| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    for row in estimate.rows:
        ranks = _ranks_text(row.ranks)
        cells = (
            str(row.pp_rank),
            ",".join(map(str, row.stages)),
            ranks,
            fmt(row.state.params),
            fmt(row.state.grads),
            fmt(row.state.optimizer),
            fmt(row.activations),
            str(row.in_flight),
            fmt(row.recompute),
            fmt(row.total),
        )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"({unit} per rank; the most any rank needs: {fmt(estimate.peak)} {unit})"]
    return "\n".join(lines)


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}–{ranks[-1]}"
    return ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]},{ranks[1]},… ({len(ranks)})"


def estimate_memory(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    world_size: int,
    batch: Any,
    *,
    precision: str = "32-true",
    optimizer: str = "adamw",
    loss_fn: Callable[..., Tensor] | None = None,
) -> MemoryEstimate:
    """Estimates each rank's memory for training ``module`` at ``config`` on ``world_size`` ranks.

    ``module`` is a LightningModule (its ``configure_model`` runs under fake tensors; its ``training_step``, or under
    pp its ``pipeline_trunk`` and ``pipeline_loss``, run one microbatch) or a callable returning an ``nn.Module``
    (then ``loss_fn(outputs, *targets)`` gives the loss and ``batch`` is ``(inputs, *targets)``). ``batch`` is one
    data-parallel rank's batch: tensors (real or meta; only shapes and dtypes are read) or a shape ``(B, T)`` of
    integer tokens, used as inputs and targets.
    ``optimizer`` names the optimizer's state layout (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``).

    Call it before launching, in a process without a default process group: it creates and destroys a fake one.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "estimate_memory() simulates every rank in this process with a fake process group, so it must run "
            "before launch (no process group yet). Call it from the launching script, or through `mode=estimate`."
        )
    layout = resolve_layout(config, world_size)
    assert layout is not None
    check_precision(precision, layout.zero)
    # The eager build: compiled blocks run the same ops on fake tensors only by compiling under fake mode, and
    # keep at most what the eager ones keep (inductor's fusions save fewer intermediates), so eager is the bound.
    config = dataclasses.replace(config, compile=False, compile_options={})
    if optimizer not in OPTIMIZER_STATE_LAYOUTS:
        raise ValueError(f"optimizer={optimizer!r} is not known. Allowed: {', '.join(OPTIMIZER_STATE_LAYOUTS)}.")
    mesh = Par3DMesh(layout)
    micro = config.microbatches if layout.pp > 1 else 1
    check_batch_splits(_rows_of(batch), micro)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer, DTensor on fake tensors
        with garbage_kept():
            stages = _measure_stages(module, config, layout, batch, micro, precision, loss_fn)
        order = _pipeline_order(layout) if layout.pp > 1 else None
    rows = []
    for pp_rank in range(layout.pp):
        mine = layout.stage_indices(pp_rank)
        per_mb = tuple(stages[s].activation_bytes for s in mine)
        if order is None:
            peak, in_flight = stages[0].activation_bytes, 1
        else:
            peak, in_flight = schedule_peak(order[pp_rank], {s: stages[s].activation_bytes for s in mine})
        recompute = max(stages[s].recompute_bytes for s in mine)
        shapes = [shape for s in mine for shape in stages[s].param_shapes]
        frozen = [flag for s in mine for flag in stages[s].frozen]
        param_b, grad_b, state_b = _DTYPE_BYTES[precision]
        state = model_state_formula(  # dp_shard rank 0: the one whose chunks are never short
            shapes,
            stage=layout.zero,
            n=layout.dp_shard,
            param_bytes=param_b,
            grad_bytes=grad_b,
            optimizer=OPTIMIZER_STATE_LAYOUTS[optimizer],
            state_bytes=state_b,
            frozen=frozen,
        )
        ranks = tuple(r for r in range(layout.world_size) if mesh.coords(r).pp == pp_rank)
        rows.append(RankEstimate(pp_rank, tuple(mine), ranks, state, peak, recompute, per_mb, in_flight))
    shape = tuple(_shape_of(_first(batch)))
    microbatch_shape = (shape[0] // micro, *shape[1:]) if shape else ()
    return MemoryEstimate(layout, precision, config.activation_checkpointing, microbatch_shape, rows)


# ---------------------------------------------------------------- one stage at a time, in a fake process group


@dataclass
class _StageMeasure:
    param_shapes: list[tuple[int, ...]]
    activation_bytes: int
    """Saved for backward by one microbatch's forward (under checkpointing: what is held until backward)."""
    recompute_bytes: int
    """Under full or selective checkpointing: the largest checkpointed block's own activations, held again while
    backward recomputes it."""
    output: Any = None
    frozen: list[bool] = field(default_factory=list)
    """Per parameter in ``param_shapes``: frozen (``requires_grad=False``)."""


def _build(module: nn.Module | Callable[[], nn.Module], precision: str) -> nn.Module:
    """A fresh copy of the model, built under the fake mode by ``configure_model`` (or the factory), in bf16 under
    ``bf16-true`` (as Lightning's precision plugin builds it), else in the default dtype. A ``.to()`` in the build
    that changes nothing (``peft`` moves each adapter it makes to its base layer's device) leaves the module as it
    is (:func:`~lightning_par3d.utils.torch_private.moves_in_place_skipped`)."""
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.get_default_dtype()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"), moves_in_place_skipped():
            if isinstance(module, nn.Module):
                with fake_mode_paused():  # a plain copy of the (unconfigured) module and whatever it holds
                    built = copy.deepcopy(module)
                configure = getattr(built, "configure_model", None)
                if callable(configure):
                    configure()
                return built
            return module()
    finally:
        torch.set_default_dtype(previous)


def _measure_stages(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    layout: Layout,
    batch: Any,
    micro: int,
    precision: str,
    loss_fn: Callable[..., Tensor] | None,
) -> list[_StageMeasure]:
    """Each pipeline stage (or the whole model) built, parallelized and run for one microbatch on fake tensors.
    One fake process group serves every stage, as global rank 0: a stage's tensor-parallel shapes depend on the tp
    coordinate only, and dp_shard rank 0 holds the largest shards."""
    fake = fake_tensor_mode()
    with fake:
        inputs = _fake_batch(batch)
        microbatch = [t[: t.shape[0] // micro] if isinstance(t, Tensor) and t.dim() else t for t in inputs]
        # The input as a copy, not a view: a view is metered at the whole batch's storage, and the first stage's
        # figure is multiplied by the microbatches in flight (the run's are views of one batch, metered once). The
        # targets stay views: the last stage, one microbatch in flight, holds the whole batch's storage as the run's.
        if microbatch and isinstance(microbatch[0], Tensor):
            microbatch[0] = microbatch[0].clone()
    carried: Any = microbatch[0]
    results: list[_StageMeasure] = []
    with fake_world(layout.world_size):
        # The run's mesh, over fake groups: real (CPU) mesh tensors, made outside the fake mode.
        mesh = Par3DMesh.build(layout, "cpu", fake_group)
        for stage in range(layout.n_stages):
            part = _Part(module, config, mesh, stage, precision, fake)
            result = part.measure(carried, microbatch, loss_fn)
            carried = result.output
            results.append(result)
    return results


@dataclass
class _Part:
    """Pipeline stage ``stage`` of the model (the whole model without pipelining), as a run builds it."""

    module: nn.Module | Callable[[], nn.Module]
    config: Par3DConfig
    mesh: Par3DMesh
    stage: int
    precision: str
    fake: Any

    def measure(self, carried: Any, microbatch: list[Any], loss_fn: Callable[..., Tensor] | None) -> _StageMeasure:
        """The part's model-state shapes, and the bytes one microbatch's forward saves for backward. Under full or
        selective checkpointing, a first build without checkpointing measures each block's own activations (what
        backward recomputes at a time)."""
        recompute = 0
        if self.config.activation_checkpointing in ("full", "selective"):
            plain = dataclasses.replace(self.config, activation_checkpointing="none")
            sizes: list[int] = []
            meter = SavedTensorMeter()
            with self.fake:
                part, blocks, run = self._parallelized(plain, carried, microbatch, loss_fn)
                hooks = _block_meters(blocks, meter, sizes)
                with autocast(self.precision), meter:
                    run()
                for hook in hooks:
                    hook.remove()
            recompute = max(sizes, default=0)
        meter = SavedTensorMeter()
        with self.fake:
            part, _, run = self._parallelized(self.config, carried, microbatch, loss_fn)
            shapes = _tp_local_shapes(part)
            frozen = [not p.requires_grad for p in part.parameters()]
            with autocast(self.precision), meter:
                output = run()
        detached = output.detach() if isinstance(output, Tensor) else None
        return _StageMeasure(shapes, meter.peak, recompute, detached, frozen)

    def _parallelized(
        self, config: Par3DConfig, carried: Any, microbatch: list[Any], loss_fn: Callable[..., Tensor] | None
    ) -> tuple[nn.Module, list[nn.Module], Callable[[], Any]]:
        """A fresh build of the part, parallelized by the run's own functions; its checkpointing blocks (found
        before FSDP2 renames their classes); and its forward on one microbatch (with the loss, on the last
        stage).

        :func:`~lightning_par3d.compose.parallelize_part` runs with the fake mode paused: FSDP2 builds
        a ``DeviceMesh`` for a parameter that is already a tp DTensor, and a mesh computes its coordinates with
        ``nonzero()``, which the fake mode refuses (its output shape depends on data). The model's tensors stay
        fake all the same: every op on them dispatches to their own fake mode."""
        layout = self.mesh.layout
        root = _build(self.module, self.precision)
        fqn_styles = build.checked_plan(root, config, layout.tp)  # the run's checks, messages and plan
        if layout.pp == 1:
            blocks = find_ac_blocks(root, config.ac_blocks)
            with fake_mode_paused():
                build.parallelize_part(
                    root, self.mesh, config, self.precision, fqn_styles, build.fsdp_blocks(root, config, layout)
                )
            return root, blocks, _whole_step(root, microbatch, loss_fn)
        spec = declared_pipeline(root)
        plan = build.plan_pipeline(root, spec, config, layout)
        shards = build.sequence_shards(config, layout)
        part = build.build_stage(getattr(root, spec.trunk), plan, self.stage, layout.n_stages, shards)
        own = [part.get_submodule(name) for name in plan.blocks[self.stage]]  # as the run checkpoints them
        blocks = own if config.ac_blocks is None else find_ac_blocks(part, config.ac_blocks)
        with fake_mode_paused():
            build.parallelize_stage(part, plan, self.stage, self.mesh, config, self.precision, fqn_styles, spec.trunk)
        inputs = carried if self.stage == 0 else torch.empty_like(carried, requires_grad=True)
        last = self.stage == layout.n_stages - 1

        def run() -> Any:
            output = part(inputs)
            if last:
                getattr(root, spec.loss)(output, *microbatch[1:])
            return output

        return part, blocks, run


def _whole_step(module: nn.Module, microbatch: list[Any], loss_fn: Callable[..., Tensor] | None) -> Callable[[], Any]:
    """One forward of the whole model with its loss: the LightningModule's ``training_step``, or ``loss_fn``."""
    if loss_fn is not None:
        return lambda: loss_fn(module(microbatch[0]), *microbatch[1:])
    step = getattr(module, "training_step", None)
    if not callable(step):
        raise TypeError("estimate_memory needs loss_fn(outputs, *targets) for a module without training_step.")
    return lambda: step(tuple(microbatch), 0)


def _block_meters(blocks: list[nn.Module], meter: SavedTensorMeter, sizes: list[int]) -> list[Any]:
    """Hooks that record, per block, the bytes its forward saves for backward."""
    hooks = []
    for block in blocks:
        start: list[int] = []
        hooks.append(block.register_forward_pre_hook(lambda _m, _a, start=start: start.append(meter.live)))
        hooks.append(block.register_forward_hook(lambda _m, _a, _o, start=start: sizes.append(meter.live - start[-1])))
    return hooks


def _tp_local_shapes(module: nn.Module) -> list[tuple[int, ...]]:
    """Each parameter's shape on tp rank 0 before data parallelism cuts it: what the ZeRO formulas take. A
    parameter FSDP2 has sharded is redistributed to its tensor-parallel placements only (a fake all-gather over its
    data-parallel mesh dimensions); the ZeRO formulas then cut it as FSDP2 does."""
    from torch.distributed.tensor import DTensor, Replicate

    shapes = []
    with torch.no_grad():
        for param in module.parameters():
            local: Tensor = param
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                kept = [p if name == "tp" else Replicate() for name, p in zip(names, param.placements, strict=True)]
                if tuple(kept) != tuple(param.placements):
                    local = param.redistribute(param.device_mesh, kept)
            shapes.append(tuple(local_tensor(local).shape))
    return shapes


# ---------------------------------------------------------------- schedule


def _pipeline_order(layout: Layout) -> dict[int, tuple[Action, ...]]:
    """torch's actions per pipeline rank for the layout's schedule (:mod:`lightning_par3d.pipeline.actions`)."""
    return pipeline_actions(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches)


# ---------------------------------------------------------------- batches


def _first(batch: Any) -> Any:
    return batch[0] if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], int) else batch


def _shape_of(item: Any) -> tuple[int, ...]:
    return tuple(item.shape) if isinstance(item, Tensor) else tuple(item)


def _rows_of(batch: Any) -> int | None:
    """The samples of one data-parallel rank's batch (a shape's first number, or the first tensor's first
    dimension); None where it has none."""
    if isinstance(batch, tuple) and batch and all(isinstance(x, int) for x in batch):
        return int(batch[0])
    first = next((x for x in (batch if isinstance(batch, (tuple, list)) else [batch]) if isinstance(x, Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() else None


def check_batch_splits(rows: int | None, microbatches: int) -> None:
    """Raises ``ValueError`` where a rank's batch of ``rows`` samples does not split into ``microbatches`` equal
    microbatches (a run refuses it too), naming both and the fix, before anything is built."""
    if rows is None or microbatches <= 1 or (rows >= microbatches and rows % microbatches == 0):
        return
    fits = next(m for m in range(microbatches, 0, -1) if rows % m == 0) if rows > 0 else 1
    raise ValueError(
        f"A data-parallel rank's batch of {rows} sample(s) does not split into microbatches={microbatches} equal "
        f"microbatches: each pipeline microbatch needs {rows / microbatches:g} samples. Give each rank a batch that "
        f"microbatches divides (a multiple of {microbatches}: batch_size, or global_batch / dp), or use "
        f"microbatches={fits} or fewer."
    )


def _fake_batch(batch: Any) -> list[Any]:
    """``batch`` as a list of (fake) tensors: tensors are copied as empty ones of the same shape and dtype; a shape
    ``(B, T)`` becomes integer tokens used as both inputs and targets."""
    if isinstance(batch, tuple) and all(isinstance(x, int) for x in batch):
        tokens = torch.zeros(batch, dtype=torch.long)
        return [tokens, tokens]
    items = list(batch) if isinstance(batch, (tuple, list)) else [batch]
    return [torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, Tensor) else x for x in items]
