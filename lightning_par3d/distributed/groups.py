"""Process groups as resources: one group per set of ranks, one mesh per layout, for the life of the process.

Every gloo or NCCL group holds threads, sockets and (on GPUs) memory; a gloo group's transport thread also wakes up
every 10 ms while idle. A long-lived process (a Hydra multirun, a notebook, a pooled test worker) runs many fits, at
one layout or at many. par3d therefore keeps two caches per process:

* the process groups, one per set of ranks (with its backend and timeout), made by :func:`group_of`: every layout of
  a world draws its groups from the same few sets (the ``tp`` pairs ``{0, 1}, {2, 3}`` of ``dp2 × tp2`` are those
  of ``pp2 × tp2``), so a process that trains at every layout of 8 ranks holds a bounded number of groups, where a
  mesh per layout would add five groups per layout;
* the meshes, one per layout, backend and timeout (:func:`acquire_mesh`): twenty fits at one layout build one mesh,
  and a model parallelized by one ``fit`` keeps working in ``test`` or a second ``fit``.

Neither is emptied between runs, on purpose. torch's DTensor caches its sharding decisions keyed by ``DeviceMesh``
equality, which compares layouts and ranks, not process groups: a mesh destroyed and built again with the same shape
(or with an equal sub-mesh: the ``tp`` slice of ``dp2 × tp2`` equals that of ``replicate2 × tp2``) would be served
cached specs that point at the destroyed groups ("Could not resolve the process group registered under the name
11"). With one group per set of ranks, equal meshes always hold the same groups, so such a cached spec is right.
Both go when the default group does (Accelerate's ``end_training`` destroys it; Lightning's Trainer never does, so
par3d destroys every group when the interpreter exits: :func:`destroy_groups_at_exit`), or earlier with
:func:`destroy_meshes`.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_par3d.config import Layout
from lightning_par3d.distributed.mesh import Par3DMesh
from lightning_par3d.utils.torch_private import default_store, set_default_group_timeout

JOIN_TIMEOUT_FLOOR_S = 300.0
"""The least time the processes get to find each other when the default group is created. Joining waits for every
rank to start, import torch and reach ``init_process_group``: on a loaded node or a slow file system that alone can
take longer than a collective timeout chosen to catch stalls, so the join gets at least this long."""

_MESHES: dict[tuple[Any, ...], Par3DMesh] = {}
"""The meshes built in this process over the current default group, by (shape, backend, timeout, device type)."""
_GROUPS: dict[tuple[Any, ...], Any] = {}
"""The process groups made by :func:`group_of` over the current default group, by (ranks, backend, timeout): the
group, or torch's ``NON_GROUP_MEMBER`` on the ranks outside it."""
_WORLD: list[Any] = [None]
"""The default group the meshes were built over."""


def default_backend(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def restart_store(timeout_s: float) -> Any | None:
    """Under torchrun's elastic agent with its shared store (``TORCHELASTIC_USE_AGENT_STORE=True``, the default):
    a client of the agent's store, with keys prefixed by this launch (the restart count and the world size), else
    None.

    The agent keeps one store for every round of its rendezvous, and ``init_process_group`` prefixes nothing per
    restart; so after a restart (a failure, or a node lost or joined) a rank could read the addresses the previous
    launch's ranks left there and connect to a dead one ("Connection refused"). A restart after a failure raises the
    restart count, a node that joins raises the world size, so the pair names one launch."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    launch = f"par3d/launch_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}_{os.environ['WORLD_SIZE']}"
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), False,
        timeout=join_timeout(timeout_s),
    )  # fmt: skip
    return dist.PrefixStore(launch, agent)


def destroy_groups_at_exit() -> None:
    """Makes the process destroy every process group (par3d's and the default one) when the interpreter exits, if
    they still exist then (registered once per process, at a par3d run's setup).

    A process that exits with gloo groups alive can abort in the interpreter's teardown ("terminate called without
    an active exception", SIGABRT, after the job's work is done): gloo's worker threads still hold finished work
    whose tensors need the interpreter that is being torn down (torch's own proposal, pytorch#179291, was to
    register this handler in ``init_process_group``). Lightning's Trainer never destroys the default group, so this
    hit par3d's Trainer jobs as well as Accelerate's, about one launch in twenty under the test suite's load.
    Destroying groups is local (no collective), so it cannot hang an exiting rank."""
    if not _EXIT_HANDLER:
        atexit.register(destroy_groups_now)
        _EXIT_HANDLER.append(True)


_EXIT_HANDLER: list[bool] = []


def destroy_groups_now() -> None:
    """Destroys every process group (par3d's and the default one), if they exist: what
    :func:`destroy_groups_at_exit` registers."""
    _MESHES.clear()
    _GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()  # every group: the default one and all those made over it


def init_default_group(device: torch.device, timeout_s: float, backend: str | None = None) -> str:
    """Initializes the default process group from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, as torchrun sets them) if nobody has, giving the ranks :func:`join_timeout` to join; returns
    its backend. The engine's ``setup`` then sets the collective timeout (:func:`set_collective_timeout`), for this
    group as for one Lightning or Accelerate created."""
    if dist.is_initialized():
        return str(dist.get_backend())
    backend = backend or default_backend(device)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device
    store = restart_store(timeout_s)
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
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
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not _WORLD[0]:
        for mesh in _MESHES.values():
            mesh.destroyed = True  # its groups went with the old default group
        _MESHES.clear()
        _GROUPS.clear()
        _WORLD[0] = world


def checkpoint_group(timeout_s: float) -> Any:
    """A gloo group of the whole world for the collectives of checkpoints written in the background
    (``async_save``), kept like the others: those collectives run on DCP's writer thread while training runs its
    own, so they must not share a group with any of training's (two threads issuing collectives on one group would
    interleave them in different orders on different ranks). Every rank calls it at the same point."""
    _forget_if_world_changed()
    key = ("checkpoint", float(timeout_s))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(timeout=timedelta(seconds=timeout_s), backend="gloo")
    return _GROUPS[key]


def group_of(ranks: list[int], backend: str, timeout_s: float) -> Any:
    """The process group of ``ranks`` (global ranks), made on first use with ``backend`` and ``timeout_s`` for its
    collectives, and kept. Every rank of the world calls it for the same sets in the same order (torch's
    ``new_group`` is a collective over the default group); a rank outside ``ranks`` gets ``NON_GROUP_MEMBER``."""
    _forget_if_world_changed()
    key = (tuple(sorted(ranks)), backend, float(timeout_s))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key[0]), timeout=timedelta(seconds=timeout_s), backend=backend)
    return _GROUPS[key]


def fake_group(ranks: list[int]) -> Any:
    """:func:`group_of` over torch's fake backend (collectives that move nothing), for the estimator and the
    planner, which build the run's mesh in a simulated world."""
    return group_of(ranks, "fake", 1800.0)


def acquire_mesh(layout: Layout, device: torch.device, backend: str, timeout_s: float) -> Par3DMesh:
    """The mesh for ``layout`` over the default group: the one this process built before for the same shape,
    backend and timeout, or a new one. Every rank must call it at the same point (it may create groups)."""
    _forget_if_world_changed()
    key = (layout.shape, layout.ep, layout.cp, backend, float(timeout_s), device.type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = Par3DMesh.build(layout, device.type, lambda ranks: group_of(ranks, backend, timeout_s))
        _MESHES[key] = mesh
    elif mesh.layout != layout:
        # The same groups; the layout's other facts (ZeRO, schedule) are this run's.
        mesh = Par3DMesh(layout, mesh.device_mesh, mesh._dp_mesh, mesh._expert_mesh, mesh._cp_group)
    return mesh


def destroy_meshes() -> int:
    """Destroys the process groups par3d made in this process (never the default group) and forgets its meshes;
    returns how many meshes there were.

    Call it when no model parallelized over them will run again (every rank at the same point, as
    ``destroy_process_group``): models built afterwards get new groups, but torch's DTensor caches may still hand
    out the destroyed meshes for equal ones (see the module docstring), so do it at the end of the work, before
    destroying the default group yourself.
    """
    _forget_if_world_changed()
    meshes = list(_MESHES.values())
    for mesh in meshes:
        mesh.destroyed = True
    live = [group for group in _GROUPS.values() if isinstance(group, dist.ProcessGroup)]
    _MESHES.clear()
    _GROUPS.clear()
    if dist.is_initialized():
        for group in live:
            dist.destroy_process_group(group)
    return len(meshes)
