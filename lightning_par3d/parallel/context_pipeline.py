"""Context parallelism under pipeline parallelism (``pp × cp``).

Under pp the trunk is split into stage modules that torch's schedule calls once per microbatch, its positional
arguments to the first stage only and its keyword arguments to every stage, each split into the microbatches'
rows. So the rows are cut in two places:

* before the schedule (:func:`lightning_par3d.engine.context_rows.cut_call`), the call's token ids (its first
  positional argument) and the targets are cut to this rank's positions
  (:func:`~lightning_par3d.parallel.context_parallel.positions_of`); the ``attention_mask`` stays whole, and
  ``position_ids`` are passed whole (``0 … T−1`` on every row when the call has none), so that the schedule splits
  them into the microbatches' rows like the ids;
* each stage's forward pre-hook (:class:`StageContextParallel`) makes the microbatch's
  :class:`~lightning_par3d.parallel.context_parallel.SequenceSlice` from them, and passes the stage this rank's
  ``position_ids`` only (and no ``attention_mask``: its blocks' attention masks by the slice).

Activation checkpointing composes: a schedule recomputes a block in the backward of a microbatch after the forwards
of later ones, and the block finds its own microbatch's slice again by its input
(:meth:`~lightning_par3d.parallel.context_parallel.ContextParallel.block`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_par3d.parallel.context_parallel import ContextParallel, check_model


class StageContextParallel(ContextParallel):
    """Context parallelism on one pipeline stage module: its pre-hook slices each microbatch's rows (see the module
    docstring); its blocks' attention is :class:`~lightning_par3d.parallel.context_parallel.ContextParallel`'s."""

    def _cut(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        kwargs = dict(kwargs)
        given = kwargs.get("position_ids")
        if not isinstance(given, torch.Tensor) or given.dim() != 2:
            raise RuntimeError(
                "cp > 1 under pp: a pipeline stage ran without the call's whole-row position_ids, which par3d adds "
                "before the schedule (Par3DEngine.run_pipeline). Run the pipelined trunk through the engine."
            )
        mask = kwargs.pop("attention_mask", None)
        batch, length = given.shape
        self.current = self.slice_rows(batch, length, given.device, mask, given, kwargs)
        self._pass(kwargs, "position_ids", given[..., self.current.positions])
        self._enter_trunk()
        return args, kwargs


def apply_stage_context_parallel(stage: nn.Module, blocks: list[nn.Module], group: Any, cp_rank: int, cp: int,
                                 ignore_index: int) -> StageContextParallel:  # fmt: skip
    """Installs context parallelism on a pipeline stage module (built, before activation checkpointing and FSDP2);
    ``blocks``: the stage's own blocks."""
    check_model(stage)
    context = StageContextParallel(stage, blocks, group, cp_rank, cp, ignore_index)
    context.install()
    return context
