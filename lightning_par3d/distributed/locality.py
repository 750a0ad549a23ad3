"""Which process groups of a layout hold ranks of more than one node.

Launchers number ranks node by node (torchrun, SLURM and Lightning's launcher alike: node ``n`` holds the ranks ``n·d …
n·d + d − 1`` for ``d`` devices per node), and par3d's mesh is row-major with ``tp`` innermost, then ``dp_shard``,
``dp_replicate`` and ``pp``. So ``tp`` stays inside a node exactly when it divides the devices per node; ``cp`` (inside
``dp_shard``) stays inside a node when ``cp × tp`` divides it; HSDP keeps its shards inside a node when ``dp_shard × cp
× tp`` does, and its replicas go across; pipeline stages go across nodes first. The planner's cost model prices a
group's collectives on the link this module says it uses, and the engine warns at setup when ``tp`` crosses nodes.
"""

from __future__ import annotations

import functools
import os

from lightning_par3d.config import Layout


def spans_nodes(shape: tuple[int, int, int, int], group: str, devices_per_node: int, cp: int = 1, ep: int = 1) -> bool:
    """Whether any ``group`` (a mesh dimension, ``dp``, ``cp``, or under ``ep > 1`` the experts' ``ep`` and
    ``expert_shard``) of the mesh ``shape`` (pp, dp_replicate, dp_shard × cp, tp) holds ranks of two nodes of
    ``devices_per_node`` ranks each."""
    pp, dp_replicate, shard_ranks, tp = shape
    return _spans(pp, dp_replicate, shard_ranks // cp, cp, ep, tp, group, devices_per_node)


@functools.cache
def _spans(
    pp: int, dp_replicate: int, dp_shard: int, cp: int, ep: int, tp: int, group: str, devices_per_node: int
) -> bool:
    from lightning_par3d.distributed.mesh import Par3DMesh

    mesh = Par3DMesh(Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, ep=ep, tp=tp))
    if mesh.layout.world_size <= devices_per_node:
        return False
    groups = mesh.all_group_ranks()[group]
    return any(len({r // devices_per_node for r in ranks}) > 1 for ranks in groups)


def tp_across_nodes(layout: Layout, devices_per_node: int) -> str | None:
    """Why ``layout``'s tensor-parallel groups would cross nodes of ``devices_per_node`` devices (the cost, and the
    fix), or None where every tp group sits inside one node."""
    if layout.tp == 1 or not spans_nodes(layout.shape, "tp", devices_per_node):
        return None
    fits = [t for t in range(1, devices_per_node + 1) if devices_per_node % t == 0 and layout.world_size % t == 0]
    return (
        f"tp={layout.tp} puts tensor-parallel groups across nodes of {devices_per_node} devices each: their "
        f"all-reduces and all-gathers run in every layer, forward and backward, and would take the link between "
        f"nodes, typically several times slower than the one inside a node. Keep tp a divisor of {devices_per_node} "
        f"(tp={max(fits)}), and give the rest to dp_shard, dp_replicate or pp."
    )


def launcher_devices_per_node(world_size: int) -> int:
    """Processes per node as the launcher says: torchrun's (and ``accelerate launch``'s) ``LOCAL_WORLD_SIZE``, else
    SLURM's ``SLURM_NTASKS_PER_NODE`` (``"4"``, or ``"4(x2)"`` for two nodes of four), else ``world_size`` (one
    node)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    slurm = os.environ.get("SLURM_NTASKS_PER_NODE")
    if slurm and "SLURM_NTASKS" in os.environ:
        return int(slurm.split("(")[0].split(",")[0])
    return world_size
