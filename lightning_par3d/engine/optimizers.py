"""The engine's optimizers: each pointed at the parallelized parameters, and wrapped for ZeRO-1/2.

An optimizer made from ``model.parameters()`` before the model was parallelized (Fabric's ``setup(model,
optimizer)``, Accelerate's ``prepare``) holds the tensors parallelization replaced: :func:`point_at_parameters`
swaps each for the parallelized parameter of the same name (and drops those another pipeline stage holds). Under
``zero_stage`` 1 or 2 each optimizer is wrapped in a :class:`~lightning_par3d.zero.optimizer.ZeroOptimizer`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_par3d.config import Layout
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.parallel.optimizer_paths import use_per_tensor_path_where_mixed
from lightning_par3d.zero.optimizer import ZeroOptimizer, wrap_optimizers


def setup_optimizers(
    optimizers: Sequence[Optimizer],
    schedulers: Iterable[Any],
    module: nn.Module,
    names_before: Mapping[torch.Tensor, str],
    layout: Layout,
    mesh: Par3DMesh,
) -> tuple[list[Optimizer], list[ZeroOptimizer]]:
    """The optimizers to step (each over ``module``'s parallelized parameters; ZeRO-1/2 wrappers, which the LR
    schedulers bound to them follow, where the layout shards optimizer state), and the ZeRO wrappers among them."""
    names: dict[torch.Tensor, str] = {p: n for n, p in module.named_parameters()}
    for optimizer in optimizers:
        point_at_parameters(optimizer, module, names_before)
        for line in use_per_tensor_path_where_mixed(optimizer, names):
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(f"par3d: {line}.", stacklevel=3)
    if layout.data_parallel != "zero":
        return list(optimizers), []
    wrapped = wrap_optimizers(list(optimizers), schedulers, layout.zero, mesh)
    return list(wrapped), list(wrapped)


def point_at_parameters(optimizer: Optimizer, module: nn.Module, names_before: Mapping[torch.Tensor, str]) -> None:
    """Replaces, in ``optimizer``'s groups, parameters of the model as it was before parallelization (named in
    ``names_before``) by ``module``'s parallelized parameters of the same name, dropping those another pipeline stage
    holds. Raises for a tensor that is no parameter of the model, or an optimizer that already stepped."""
    current = dict(module.named_parameters())
    mine = set(current.values())
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if param in mine:
                params.append(param)
                continue
            name = names_before.get(param)
            if name is None:
                raise ValueError(
                    f"{type(optimizer).__name__} holds a tensor of shape {tuple(param.shape)} that is not a "
                    "parameter of the parallelized model. Create the optimizer from model.parameters() after "
                    "parallelizing (or preparing) the model, or pass it together with the model."
                )
            if name in current:
                params.append(current[name])
        if optimizer.state and params != group["params"]:
            raise RuntimeError(
                f"{type(optimizer).__name__} already stepped over the parameters of the model before it was "
                "parallelized; its state cannot follow them. Create the optimizer before its first step."
            )
        group["params"] = params
