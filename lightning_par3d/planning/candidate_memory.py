"""Each candidate's memory: :func:`lightning_par3d.estimate_memory`'s figures, without running it for every layout.

The estimator's cost is its fake build and forward of every stage (about a second a layout on a small CPU); a plan
compares hundreds of layouts. Its result is made of three parts, and layouts share the expensive one:

* **activations per microbatch of each stage, and the recompute peak of each rank**: they depend on the stages (``pp``,
  stages per rank and their placement), ``tp``, ``cp``, ``ep`` (with ``dp_shard`` under ``ep > 1``), activation
  checkpointing, the microbatch's size, the precision, and, under ``-mixed`` precision only, on whether FSDP2 serves the
  layout (its mixed-precision policy gathers parameters in bf16, so autocast makes no copies of them); not on how the
  data-parallel ranks are split or on the ZeRO stage. :class:`MemoryModel` runs the estimator for the first layout of
  each such class;
* **microbatches in flight**: the walk over torch's schedule order
  (:func:`~lightning_par3d.pipeline.actions.schedule_peak`, the estimator's walk), per layout;
* **model state**: the ZeRO formulas (:func:`~lightning_par3d.zero.formula.model_state_formula`, which the
  estimator calls) on each rank's tensor-parallel shapes (:func:`~lightning_par3d.planning.probe.stage_params`),
  per layout.

Every class checks itself: the figures composed this way for the layout the estimator ran on must equal the
estimator's own, field by field; where they do not, every layout of that class is estimated by the estimator
itself. So a plan's memory is the estimator's, layout by layout (the tests compare them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.config.schedules import V_SCHEDULES
from lightning_par3d.distributed.fakeworld import forget_meshes, keep_excepthook
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.memory.estimate import MemoryEstimate, RankEstimate, estimate_memory
from lightning_par3d.memory.stage_measure import SharedMeasures
from lightning_par3d.parallel.precision import element_bytes
from lightning_par3d.pipeline.actions import pipeline_actions, schedule_peak
from lightning_par3d.planning.probe import StageParams
from lightning_par3d.zero.formula import OPTIMIZER_STATE_LAYOUTS, model_state_formula


@dataclass
class MemoryModel:
    """The estimator's figures for many layouts of one model, batch and precision (see the module docstring)."""

    module: nn.Module | Callable[[], nn.Module]
    world_size: int
    seq_len: int
    precision: str
    optimizer: str
    loss_fn: Callable[..., Tensor] | None
    params_of: Callable[[Layout], list[StageParams]]
    """The tensor-parallel shapes of every stage of a layout (cached by the caller)."""
    estimator_calls: int = 0
    shared: SharedMeasures = field(default_factory=SharedMeasures)
    """The stage measures the estimator runs share (:class:`~lightning_par3d.memory.stage_measure.SharedMeasures`)."""
    _classes: dict[tuple[Any, ...], MemoryEstimate] = field(default_factory=dict)
    _exact_only: set[tuple[Any, ...]] = field(default_factory=set)

    def estimate(
        self, config: Par3DConfig, layout: Layout, rank_batch: int, checkpoints_blocks: bool = True
    ) -> MemoryEstimate:
        """What ``estimate_memory(module, config, world_size, (rank_batch, seq_len), ...)`` returns for this
        layout; raises its ``ValueError`` where it raises one. ``checkpoints_blocks=False`` says that no stage has
        a block for activation checkpointing to wrap (a stage of one block: par3d then checkpoints nothing), so the
        layout's activations are those without checkpointing."""
        key = self._class_of(config, layout, rank_batch, checkpoints_blocks)
        known = self._classes.get(key)
        if known is not None and key not in self._exact_only:
            return self.compose(known, config, layout, rank_batch)
        estimate = self._run_estimator(config, rank_batch)
        if known is None and key not in self._exact_only:
            if self.compose(estimate, config, layout, rank_batch) == estimate:
                self._classes[key] = estimate
            else:
                self._exact_only.add(key)
        return estimate

    def _class_of(
        self, config: Par3DConfig, layout: Layout, rank_batch: int, checkpoints_blocks: bool
    ) -> tuple[Any, ...]:
        """Layouts of one class have the same stages, tp, cp, checkpointing, microbatch and precision policy, hence
        the same activations per stage. Where checkpointing recomputes, the recompute peak is per rank, so the stages'
        placement on the ranks (looped or V) counts too."""
        from lightning_par3d.parallel.precision import fsdp_mixed_precision

        micro = rank_batch // (layout.microbatches if layout.pp > 1 else 1)
        gathers_low = layout.data_parallel == "fsdp" and fsdp_mixed_precision(self.precision) is not None
        ac = config.activation_checkpointing if checkpoints_blocks else "none"
        recomputes = ac in ("full", "selective")
        return (
            layout.pp,
            layout.stages_per_rank,
            recomputes and layout.pp > 1 and layout.schedule in V_SCHEDULES,
            layout.tp,
            layout.cp,
            (layout.ep, layout.dp_shard) if layout.ep > 1 else 1,  # the experts a rank holds, and how FSDP2 cuts them
            ac,
            config.ac_every if ac == "selective" else None,
            micro,
            gathers_low,
        )

    def _run_estimator(self, config: Par3DConfig, rank_batch: int) -> MemoryEstimate:
        self.estimator_calls += 1
        with keep_excepthook(), forget_meshes():
            return estimate_memory(
                self.module,
                config,
                self.world_size,
                (rank_batch, self.seq_len),
                precision=self.precision,
                optimizer=self.optimizer,
                loss_fn=self.loss_fn,
                shared_measures=self.shared,
            )

    def compose(self, known: MemoryEstimate, config: Par3DConfig, layout: Layout, rank_batch: int) -> MemoryEstimate:
        """``layout``'s estimate from ``known``, the estimate of a layout of the same class: its stages'
        activations and recompute, this layout's schedule walk and model state."""
        per_stage = {
            s: b for row in known.rows for s, b in zip(row.stages, row.activations_per_microbatch, strict=True)
        }
        recompute = {row.stages: row.recompute for row in known.rows}
        placements = {tuple(layout.stage_indices(r)) for r in range(layout.pp)}
        if any(recompute.values()) and not placements <= set(recompute):
            raise RuntimeError(
                "A memory class mixes stage placements under recompute; the class key must tell them apart."
            )
        params = self.params_of(layout)
        micro = layout.microbatches if layout.pp > 1 else 1
        actions = (
            pipeline_actions(layout.schedule, layout.pp, layout.virtual_stages, layout.microbatches)
            if layout.pp > 1
            else None
        )
        sizes = element_bytes(self.precision)
        param_b, grad_b, state_b = sizes.param, sizes.grad, sizes.state
        mesh = Par3DMesh(layout)
        rows = []
        for pp_rank in range(layout.pp):
            mine = tuple(layout.stage_indices(pp_rank))
            if actions is None:
                peak, in_flight = per_stage[0], 1
            else:
                peak, in_flight = schedule_peak(actions[pp_rank], {s: per_stage[s] for s in mine})
            state = model_state_formula(
                [shape for s in mine for shape in params[s].shapes],
                stage=layout.zero,
                n=layout.shard_ranks,
                param_bytes=param_b,
                grad_bytes=grad_b,
                optimizer=OPTIMIZER_STATE_LAYOUTS[self.optimizer],
                state_bytes=state_b,
                frozen=[flag for s in mine for flag in params[s].frozen or (False,) * len(params[s].shapes)],
            )
            ranks = mesh.pipeline_ranks(pp_rank)
            per_mb = tuple(per_stage[s] for s in mine)
            rebuilt = recompute.get(mine, 0)  # another placement of the same stages, in a class without recompute
            rows.append(RankEstimate(pp_rank, mine, ranks, state, peak, rebuilt, per_mb, in_flight))
        shape = (rank_batch // micro, self.seq_len)
        return MemoryEstimate(layout, self.precision, config.activation_checkpointing, shape, rows)
