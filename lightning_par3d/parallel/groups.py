"""Process groups as resources: one mesh per layout and process, reused by every run of that layout.

Every gloo or NCCL group holds threads, sockets and (on GPUs) memory. A long-lived process (a Hydra multirun, a
notebook, a pooled test worker) runs many fits; a mesh built per fit and never destroyed piles up groups (twelve
threads per fit at dp_shard=2 on gloo). par3d therefore keeps the meshes it builds in one list per process, and
:func:`acquire_mesh` returns the existing mesh of the same layout, backend and timeout: twenty fits at one layout
create one set of groups, and a model parallelized by one ``fit`` keeps working in ``test`` or a second ``fit``.

Meshes are not destroyed between runs, on purpose. torch's DTensor caches its sharding decisions keyed by
``DeviceMesh`` equality, which compares layouts and ranks, not process groups: a mesh destroyed and built again
with the same shape (or with an equal sub-mesh: the ``tp`` slice of ``dp2 × tp2`` equals that of
``replicate2 × tp2``) would be served cached specs that point at the destroyed groups ("Could not resolve the
process group registered under the name 11"). Keeping them bounds the groups by the number of distinct layouts a
process uses. They go when the default group does (Lightning and Accelerate destroy it at exit), or earlier with
:func:`destroy_meshes`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from lightning_par3d.config import Layout
from lightning_par3d.parallel.mesh import Par3DMesh
from lightning_par3d.torch_private import default_store, set_default_group_timeout

JOIN_TIMEOUT_FLOOR_S = 300.0
"""The least time the processes get to find each other when the default group is created. Joining waits for every
rank to start, import torch and reach ``init_process_group``: on a loaded node or a slow file system that alone can
take longer than a collective timeout chosen to catch stalls, so the join gets at least this long."""

_MESHES: dict[tuple[Any, ...], Par3DMesh] = {}
"""The meshes built in this process over the current default group, by (shape, backend, timeout, device type)."""
_WORLD: list[Any] = [None]
"""The default group the meshes were built over."""


def default_backend(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_default_group(device: torch.device, timeout_s: float, backend: str | None = None) -> str:
    """Initializes the default process group from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, as torchrun sets them) if nobody has, giving the ranks :func:`join_timeout` to join; returns
    its backend. The engine's ``setup`` then sets the collective timeout (:func:`set_collective_timeout`), for this
    group as for one Lightning or Accelerate created."""
    import torch.distributed as dist

    if dist.is_initialized():
        return str(dist.get_backend())
    backend = backend or default_backend(device)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(backend, timeout=join_timeout(timeout_s), **kwargs)
    return backend


def join_timeout(timeout_s: float) -> timedelta:
    """How long ``init_process_group`` waits for every rank to join: the collective timeout, but at least
    :data:`JOIN_TIMEOUT_FLOOR_S`. :func:`set_collective_timeout` then gives the default group the real one."""
    return timedelta(seconds=max(float(timeout_s), JOIN_TIMEOUT_FLOOR_S))


def set_collective_timeout(timeout_s: float) -> None:
    """Gives the default group's collectives, and its key-value store, ``timeout_s``, whoever created the group
    (Lightning, Accelerate, torchrun's user): a collective or a store call (creating sub-groups, par3d's step
    notes) that waits longer raises on the ranks that wait, and par3d ends the job."""
    timeout = timedelta(seconds=timeout_s)
    set_default_group_timeout(timeout)
    default_store().set_timeout(timeout)


def _forget_if_world_changed() -> None:
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not _WORLD[0]:
        for mesh in _MESHES.values():
            mesh.destroyed = True  # its groups went with the old default group
        _MESHES.clear()
        _WORLD[0] = world


def acquire_mesh(layout: Layout, device: torch.device, backend: str, timeout_s: float) -> Par3DMesh:
    """The mesh for ``layout`` over the default group: the one this process built before for the same shape,
    backend and timeout, or a new one. Every rank must call it at the same point (it may create groups)."""
    _forget_if_world_changed()
    key = (layout.shape, backend, float(timeout_s), device.type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = Par3DMesh.build(layout, device.type, backend, timedelta(seconds=timeout_s))
        _MESHES[key] = mesh
    elif mesh.layout != layout:
        # The same groups; the layout's other facts (ZeRO, schedule) are this run's.
        mesh = Par3DMesh(layout, mesh.device_mesh, mesh._dp_mesh)
    return mesh


def destroy_meshes() -> int:
    """Destroys the process groups of every mesh par3d built in this process; returns how many meshes.

    Call it when no model parallelized over them will run again (every rank at the same point, as
    ``destroy_process_group``): models built afterwards get new groups, but torch's DTensor caches may still hand
    out the destroyed meshes for equal ones (see the module docstring), so do it at the end of the work, before
    destroying the default group yourself.
    """
    _forget_if_world_changed()
    meshes = list(_MESHES.values())
    for mesh in meshes:
        mesh.destroy()
    _MESHES.clear()
    return len(meshes)
