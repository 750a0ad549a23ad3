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

Building and measuring the stages is :mod:`lightning_par3d.memory.stage_measure`'s: the model is built once per
estimate, and a pipeline stage of alike blocks is measured at one and two blocks and extended to its depth, so an
estimate of a 32-block model costs what one of a 4-block model does.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.distributed.fakeworld import collector_paused
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.memory.meters import ModelStateBytes
from lightning_par3d.memory.stage_measure import SharedMeasures, measure_stages
from lightning_par3d.parallel.precision import check_precision
from lightning_par3d.pipeline.actions import Action, pipeline_actions, schedule_peak
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
    shared_measures: SharedMeasures | None = None,
) -> MemoryEstimate:
    """Estimates each rank's memory for training ``module`` at ``config`` on ``world_size`` ranks.

    ``module`` is a LightningModule (its ``configure_model`` runs under fake tensors; its ``training_step``, or under
    pp its ``pipeline_trunk`` and ``pipeline_loss``, run one microbatch) or a callable returning an ``nn.Module``
    (then ``loss_fn(outputs, *targets)`` gives the loss and ``batch`` is ``(inputs, *targets)``). ``batch`` is one
    data-parallel rank's batch: tensors (real or meta; only shapes and dtypes are read) or a shape ``(B, T)`` of
    integer tokens, used as inputs and targets.
    ``optimizer`` names the optimizer's state layout (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``).
    ``shared_measures``: one :class:`~lightning_par3d.memory.stage_measure.SharedMeasures` given to many estimates
    of the same ``module``, ``batch``, ``precision`` and ``loss_fn`` (the planner's layouts), which then measure each
    stage role's blocks once where their settings agree.

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
        with collector_paused():
            stages = measure_stages(module, config, layout, batch, micro, precision, loss_fn, shared_measures)
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
            n=layout.shard_ranks,
            param_bytes=param_b,
            grad_bytes=grad_b,
            optimizer=OPTIMIZER_STATE_LAYOUTS[optimizer],
            state_bytes=state_b,
            frozen=frozen,
        )
        ranks = mesh.pipeline_ranks(pp_rank)
        rows.append(RankEstimate(pp_rank, tuple(mine), ranks, state, peak, recompute, per_mb, in_flight))
    shape = tuple(_shape_of(_first(batch)))
    microbatch_shape = (shape[0] // micro, *shape[1:]) if shape else ()
    return MemoryEstimate(layout, precision, config.activation_checkpointing, microbatch_shape, rows)


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
