"""The engine's collectives over the ranks that hold different data: the data-parallel ranks.

Tensor-parallel peers hold the same samples and the same logged values; context-parallel peers hold slices of the
same rows and are reduced with the data-parallel ranks (the ``dp`` group holds both: ``layout.dp_cp`` ranks); under
pp every stage holds the last stage's loss, and the outputs exist on the ranks holding the last stage. So a logged
number is reduced over the dp group only (:func:`reduce`), a batch's values are gathered over it and handed to every
pipeline rank (:func:`gather`), and torchmetrics metrics sync over it (:func:`metric_sync`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_par3d.config import Layout
from lightning_par3d.distributed.gather import gather_objects, gather_tensors, map_tensors
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.distributed.metric_sync import SyncFn, metric_sync_fn
from lightning_par3d.pipeline.runner import PipelineRunner

REDUCE_OPS = ("mean", "sum", "max", "min")


def metric_sync(layout: Layout, mesh: Par3DMesh, rank: int) -> SyncFn:
    """The torchmetrics ``dist_sync_fn`` for this layout: gather over the data-parallel ranks that hold the outputs,
    and hand the result to every pipeline stage (see :mod:`lightning_par3d.distributed.metric_sync`)."""
    dp_group = mesh["dp"].get_group()
    if layout.pp == 1:
        return metric_sync_fn(dp_group)
    last = mesh.group_ranks("pp", rank)[layout.last_stage_owner]
    return metric_sync_fn(dp_group, mesh["pp"].get_group(), last)


def gather(
    data: Any,
    as_objects: bool,
    layout: Layout,
    mesh: Par3DMesh,
    holds_last_stage: bool,
    pipeline: PipelineRunner | None,
    device: torch.device,
) -> Any:
    """The batch values ``data`` of every data-parallel rank, on every rank: tensors (nested in lists, tuples or
    dicts) concatenated on the first dimension, or, with ``as_objects``, a list's items in rank order (pickled).
    Under pp the values are the last stage's; they reach every pipeline rank."""
    group, size = mesh["dp"].get_group(), layout.dp_cp
    if holds_last_stage:
        gathered = gather_objects(data, group, size) if as_objects else gather_tensors(data, group, size)
    else:
        gathered = None
    if layout.pp == 1:
        return gathered
    assert pipeline is not None, "pp > 1 without a pipeline runner"
    cpu = gathered if as_objects else map_tensors(lambda t: t.detach().cpu(), gathered)
    received = pipeline.broadcast_object_from_last_stage(cpu)
    return received if as_objects else map_tensors(lambda t: t.to(device), received)


def reduce(tensor: torch.Tensor, op: Any, layout: Layout, mesh: Par3DMesh, device: torch.device) -> torch.Tensor:
    """``tensor`` reduced over the data-parallel ranks by ``op`` (see :func:`reduce_op_name`); a new tensor, the
    same on every rank of the data-parallel group."""
    name = reduce_op_name(op)
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    result = tensor.detach().to(device, copy=True)
    if layout.dp_cp > 1:
        dist.all_reduce(result, op=ops[name], group=mesh["dp"].get_group())
    return result / layout.dp_cp if name == "mean" else result


def reduce_op_name(op: Any) -> str:
    """The name of a reduction as Lightning, Fabric or Accelerate pass it: None (mean), a string (``"avg"`` is
    ``"mean"``; case does not matter) or a ``torch.distributed.ReduceOp``. Raises ``ValueError`` for others."""
    if op is None:
        return "mean"
    if isinstance(op, str):
        name = {"avg": "mean"}.get(op.lower(), op.lower())
    else:
        names = {
            dist.ReduceOp.SUM: "sum",
            dist.ReduceOp.MAX: "max",
            dist.ReduceOp.MIN: "min",
            dist.ReduceOp.AVG: "mean",
        }
        name = names.get(op, repr(op))
    if name not in REDUCE_OPS:
        raise ValueError(f"reduce op {op!r} is not one of 'mean' ('avg'), 'sum', 'max', 'min'.")
    return name
