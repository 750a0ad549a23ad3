"""Gradient norm and clipping across every parallel dimension.

Under par3d the gradients are DTensors on different meshes: a tensor-parallel weight lives on ``(dp, tp)``, a
replicated norm weight on ``dp`` only. ``torch.nn.utils.clip_grad_norm_`` cannot stack norms from different meshes,
so the norm is taken per (mesh, placements) group with ``get_total_norm``, each group's DTensor norm is reduced to
a plain tensor by DTensor itself (``full_tensor()``: its own all-reduce over the shard dims), and the groups'
norms are combined; under pipelining, the pipeline ranks' norms are then combined over the pp group. The result is
the norm of the whole model's gradient, identical on every rank and equal to what a single process computes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _group_key(grad: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor):
        return (grad.device_mesh, tuple(grad.placements))
    return None


def total_grad_norm(grads: Iterable[torch.Tensor], norm_type: float = 2.0, pp_group: Any = None) -> torch.Tensor:
    """The ``norm_type``-norm of all ``grads`` together, as a plain (non-DTensor) scalar tensor. With ``pp_group``,
    the pipeline ranks' norms (each over its own stages) are combined into the whole model's norm."""
    total = _local_total_norm(grads, norm_type)
    if pp_group is None:
        return total
    import torch.distributed as dist

    if norm_type == float("inf"):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        return total
    powered = total**norm_type
    dist.all_reduce(powered, group=pp_group)
    return powered ** (1.0 / norm_type)


def _local_total_norm(grads: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(_group_key(grad), []).append(grad)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    return torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type=norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, pp_group: Any = None
) -> torch.Tensor:
    """Scales the gradients of ``parameters`` in place so that their global norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``, capped at 1); returns the
    norm before clipping.
    """
    return clip_grads_([p.grad for p in parameters if p.grad is not None], max_norm, norm_type, pp_group)


def optimizer_grads(optimizer: Any) -> list[torch.Tensor]:
    """The gradients ``optimizer`` will step with: its parameters' ``.grad``, or, under ZeRO stage 2 (where each
    rank holds only its rows of the gradients), those rows as DTensors."""
    from lightning_par3d.zero import zero_optimizers

    zero = zero_optimizers([optimizer])
    if zero and zero[0].stage == 2:
        return zero[0].shard_grads()
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def clip_optimizer_grads(optimizer: Any, max_norm: float, norm_type: float = 2.0, pp_group: Any = None) -> torch.Tensor:
    """:func:`clip_grads_` on :func:`optimizer_grads`: what ``gradient_clip_val`` does under par3d."""
    return clip_grads_(optimizer_grads(optimizer), max_norm, norm_type, pp_group)


def clip_grads_(
    grads: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, pp_group: Any = None
) -> torch.Tensor:
    """Scales ``grads`` in place so that their global norm is at most ``max_norm``; returns the norm before."""
    from torch.distributed.tensor import DTensor

    total = total_grad_norm(grads, norm_type, pp_group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))
    return total
