"""The rows of a pipelined call under context parallelism, cut before torch's schedule runs
(see :mod:`lightning_par3d.parallel.context_pipeline`)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_par3d.parallel.context_parallel import ContextParallel
from lightning_par3d.pipeline.runner import PendingPipelineOutput


def cut_call(pending: PendingPipelineOutput, targets: Any, context: ContextParallel) -> tuple[Any, Any]:
    """A pipelined trunk call and its targets as this rank's stages take them under cp (see the module docstring)."""
    given = pending.args[0] if pending.args else pending.kwargs.get("input_ids")
    if not isinstance(given, torch.Tensor) or given.dim() != 2:
        raise ValueError(
            "cp > 1 under pp cuts the token ids, (batch, sequence), which a pipelined trunk takes as its first "
            "positional argument or as input_ids=; this call has neither."
        )
    ids = given
    batch, length = ids.shape
    positions = context.slice_rows(batch, length, ids.device, None, None, {}).positions
    kwargs = dict(pending.kwargs)
    if kwargs.get("position_ids") is None:
        kwargs["position_ids"] = torch.arange(length, device=ids.device).expand(batch, length)
    elif kwargs["position_ids"].shape[0] != batch:
        kwargs["position_ids"] = kwargs["position_ids"].expand(batch, length)
    if pending.args:
        cut = PendingPipelineOutput((ids[:, positions], *pending.args[1:]), kwargs)
    else:
        cut = PendingPipelineOutput((), {**kwargs, "input_ids": ids[:, positions]})
    if isinstance(targets, torch.Tensor) and targets.dim() >= 2 and targets.shape[1] == length:
        targets = targets[:, positions.to(targets.device)]
    return cut, targets
