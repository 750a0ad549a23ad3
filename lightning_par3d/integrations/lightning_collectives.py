"""The Trainer's collectives: what ``self.log(..., sync_dist=True)``, ``ModelCheckpoint`` and ``EarlyStopping`` call,
each over the groups par3d's layout gives them."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_par3d.engine import Par3DEngine


class LayoutCollectives(ParallelStrategy):
    """Mixed into :class:`~lightning_par3d.integrations.trainer.Par3DStrategy` (which sets ``engine``)."""

    engine: Par3DEngine

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """What ``self.log(..., sync_dist=True)`` calls: reduces over the data-parallel ranks only (tensor-parallel
        peers hold the same value; every pipeline rank logs the last stage's), unless a ``group`` is given. Ranks at
        different pipeline stages are in different data-parallel groups, so their logged keys never pair."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is not None:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return self.engine.reduce(tensor, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agreed over every rank (ModelCheckpoint, EarlyStopping)."""
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, None, reduce_op="sum")
        return bool(flag == self.world_size) if all else bool(flag)
