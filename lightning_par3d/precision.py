"""The precision plugin par3d installs in the Trainer: fp32, with gradient clipping by the global norm."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par3d.gradients import clip_grad_norm_


class Par3DPrecision(Precision):
    """``precision="32-true"`` whose ``gradient_clip_val`` clips by the norm over every tp, dp (and pp) shard,
    so that each rank scales by the same factor a single process would."""

    pp_group: Any = None
    """The pipeline group, set by the strategy under pp > 1, so that the norm covers every stage."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(self.main_params(optimizer), float(clip_val), pp_group=self.pp_group)
