"""Gradient norm and clipping across every parallel dimension.

Under par3d the gradients are DTensors on different meshes: a tensor-parallel weight lives on ``(dp, tp)``, a
replicated norm weight on ``dp`` only. ``torch.nn.utils.clip_grad_norm_`` cannot stack norms from different meshes,
so the norm is taken per (mesh, placements) group: ``get_total_norm`` over the group's local shards, reduced to a
plain tensor over the mesh dimensions a member's norm is partial on (one all-reduce per dimension, as DTensor's
own ``full_tensor()`` does), and the groups' norms are combined; under pipelining, the pipeline ranks' norms are then
combined over the pp group. The result is the norm of the whole model's gradient, identical on every rank and equal
to what a single process computes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


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
    if norm_type == float("inf"):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        return total
    powered = total**norm_type
    dist.all_reduce(powered, group=pp_group)
    return powered ** (1.0 / norm_type)


def _local_total_norm(grads: Iterable[torch.Tensor], norm_type: float) -> torch.Tensor:
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(_group_key(grad), []).append(grad)
    if not groups:
        return torch.tensor(0.0)
    norms = [
        _group_norm(members, norm_type) if key is not None else _plain_norm(members, norm_type)
        for key, members in groups.items()
    ]
    device = norms[0].device
    return _plain_norm([n.to(device) for n in norms], norm_type)


def _plain_norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(tensors, norm_type=norm_type)


def _group_norm(members: list[Any], norm_type: float) -> torch.Tensor:
    """The norm of DTensors that share a mesh and placements, as a plain tensor. Each rank takes the norm of its
    local shards (torch's ``get_total_norm``, foreach where the device has it), then the ranks' norms are combined
    over the mesh dimensions on which one tensor's norm is partial (those it is sharded on, as DTensor's own norm
    says). Stacking the per-tensor DTensor norms instead, as ``get_total_norm`` would, makes DTensor redistribute
    them, and it warns on every rank about "sequential all_reduce operations" over two partial dimensions."""
    partial = torch.linalg.vector_norm(members[0], norm_type)  # DTensor's placements of one member's norm
    dims = [i for i, placement in enumerate(partial.placements) if placement.is_partial()]
    local = _plain_norm([m.to_local() for m in members], norm_type)
    mesh = members[0].device_mesh
    if norm_type == float("inf"):
        for dim in dims:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        return local
    powered = local**norm_type
    for dim in dims:
        dist.all_reduce(powered, group=mesh.get_group(dim))
    return powered ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, pp_group: Any = None
) -> torch.Tensor:
    """Scales the gradients of ``parameters`` in place so that their global norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``, capped at 1); returns the
    norm before clipping.
    """
    return clip_grads_([p.grad for p in parameters if p.grad is not None], max_norm, norm_type, pp_group)


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
