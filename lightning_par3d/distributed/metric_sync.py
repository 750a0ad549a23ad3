"""Which ranks a torchmetrics metric syncs over: the data-parallel ranks that hold the model's outputs.

By default a torchmetrics ``Metric`` gathers its states over the whole world: tensor-parallel peers then count
every sample tp times, and under pipelining the stages without outputs add empty or wrong states. The sync function
that :func:`attach_metric_sync` gives each metric gathers over this rank's data-parallel group only (its peers at
the same pipeline stage and tp coordinate), and, under pipelining, hands every stage what the last stage gathered,
so ``compute()`` returns the single-process value on every rank. Metrics whose user set a ``process_group`` or a
``dist_sync_fn`` of their own keep them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SyncFn = Callable[..., list[torch.Tensor]]


def metric_sync_fn(dp_group: Any, pp_group: Any = None, last_stage_rank: int = 0) -> SyncFn:
    """A torchmetrics ``dist_sync_fn``: each state gathered over ``dp_group`` (one tensor per data-parallel rank);
    with ``pp_group``, the gathered list of the rank ``last_stage_rank`` (global) on every pipeline rank."""

    def sync(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        from torchmetrics.utilities.distributed import gather_all_tensors

        gathered = gather_all_tensors(tensor, group=dp_group)
        if pp_group is None:
            return gathered
        box: list[Any] = [[t.detach().cpu() for t in gathered]]
        dist.broadcast_object_list(box, src=last_stage_rank, group=pp_group)
        return [t.to(tensor.device) for t in box[0]]

    sync.par3d = True  # type: ignore[attr-defined]
    return sync


def attach_metric_sync(modules: Iterable[nn.Module], sync: SyncFn, pipelined: bool = False) -> int:
    """Gives every torchmetrics metric in ``modules`` (and below) the sync function, unless its user chose a
    ``process_group`` or ``dist_sync_fn``; returns how many metrics got it. Under pipelining (``pipelined``) a list
    state that is not concatenated would make a different number of collectives on different stages: refused."""
    try:
        from torchmetrics import Metric
        from torchmetrics.utilities.data import dim_zero_cat
    except ImportError:
        return 0
    count = 0
    for module in modules:
        for metric in module.modules():
            if not isinstance(metric, Metric):
                continue
            own = metric.process_group is not None or (
                metric.dist_sync_fn is not None and not getattr(metric.dist_sync_fn, "par3d", False)
            )
            if own:
                continue
            for name, default in metric._defaults.items():
                if pipelined and isinstance(default, list) and metric._reductions[name] is not dim_zero_cat:
                    raise ValueError(
                        f"{type(metric).__name__}.{name} is a list state reduced by {metric._reductions[name]}; "
                        "par3d syncs list states that are concatenated ('cat') only. Give the metric a "
                        "dist_sync_fn of your own, or use a 'cat' state."
                    )
            metric.dist_sync_fn = sync
            count += 1
    return count


def quiet_compute_before_update() -> None:
    """On a pipeline stage that does not hold the model's outputs a metric is never updated: its ``compute()``
    returns what the last stage gathered (:func:`metric_sync_fn`), and torchmetrics' warning that ``compute`` came
    before ``update`` is wrong there. Its ``rank_zero_warn`` prints on rank 0, which under pipelining is always such
    a stage, so every pipelined run would print it. Ignored in this process only (a rank of a non-last stage);
    calling it again adds nothing."""
    warnings.filterwarnings(
        "ignore", message=r"The ``compute`` method of metric \w+ was called before the ``update``", category=UserWarning
    )
