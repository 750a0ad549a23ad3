"""The named device mesh: ``pp × dp_replicate × dp_shard × tp``, row-major, ``tp`` innermost.

:class:`Par3DMesh` answers layout questions (a rank's coordinates, the ranks of its groups, its pipeline neighbours)
with plain arithmetic, so it works and is tested without processes. :meth:`Par3DMesh.build` adds the real
``DeviceMesh`` once the default process group exists; every sub-group, the flattened ``dp`` group included, gets
the configured collective timeout. :meth:`Par3DMesh.destroy` destroys the sub-groups it created (never the default
group); :mod:`lightning_par3d.parallel.groups` decides when.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from lightning_par3d.config import Layout
from lightning_par3d.torch_private import flatten_mesh, nccl_options

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Mesh dimension names, outermost first. Adjacent ranks differ in ``tp`` first, so tp stays inside a node."""

GROUP_NAMES = (*DIM_NAMES, "dp")
"""Groups that :meth:`Par3DMesh.group_ranks` knows: each dimension, and ``dp`` = ``dp_replicate × dp_shard``."""


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in the mesh."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int


class Par3DMesh:
    """Rank arithmetic over a :class:`~lightning_par3d.config.Layout`, plus the ``DeviceMesh`` once built."""

    def __init__(
        self, layout: Layout, device_mesh: DeviceMesh | None = None, dp_mesh: DeviceMesh | None = None
    ) -> None:
        self.layout = layout
        self._device_mesh = device_mesh
        self._dp_mesh = dp_mesh
        """The flattened ``dp`` mesh as :func:`~lightning_par3d.torch_private.flatten_mesh` returned it (slicing it from
        the root is deprecated)."""
        self.destroyed = False

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layout.pp, self.layout.dp_replicate, self.layout.dp_shard, self.layout.tp)

    def coords(self, rank: int) -> Coords:
        """The (pp, dp_replicate, dp_shard, tp) coordinates of a global rank."""
        self._check_rank(rank)
        values = []
        for size in reversed(self.shape):
            values.append(rank % size)
            rank //= size
        pp, dp_replicate, dp_shard, tp = reversed(values)
        return Coords(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    def rank_of(self, coords: Coords) -> int:
        """The global rank at ``coords``."""
        rank = 0
        for value, size, name in zip(
            (coords.pp, coords.dp_replicate, coords.dp_shard, coords.tp), self.shape, DIM_NAMES, strict=True
        ):
            if not 0 <= value < size:
                raise ValueError(f"Coordinate {name}={value} is outside the mesh, whose {name} size is {size}.")
            rank = rank * size + value
        return rank

    def dp_rank(self, rank: int) -> int:
        """The rank's index among the data-parallel ranks: which slice of each global batch it reads."""
        c = self.coords(rank)
        return c.dp_replicate * self.layout.dp_shard + c.dp_shard

    def group_ranks(self, group: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``group`` (a dimension name, or ``dp``), in mesh order."""
        if group not in GROUP_NAMES:
            raise ValueError(f"Unknown mesh group {group!r}. Known: {', '.join(GROUP_NAMES)}.")
        free = ("dp_replicate", "dp_shard") if group == "dp" else (group,)
        mine = self.coords(rank)
        return [r for r in range(self.layout.world_size) if self._same_except(self.coords(r), mine, free)]

    @property
    def device_mesh(self) -> DeviceMesh:
        if self.destroyed:
            raise RuntimeError(
                "This par3d mesh's process groups were destroyed (nothing held them any more). A model parallelized "
                "over it cannot run again: build a fresh model, or resume it from a checkpoint."
            )
        if self._device_mesh is None:
            raise RuntimeError(
                "The DeviceMesh exists only after the processes have initialized: call Par3DMesh.build(...) "
                "(the strategy does this in setup_environment)."
            )
        return self._device_mesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """A sub-mesh: a dimension name, ``dp`` (flattened ``dp_replicate × dp_shard``), or ``fsdp`` (the 2D
        ``(dp_replicate, dp_shard)`` mesh that FSDP2 shards over, HSDP when dp_replicate > 1)."""
        if name == "fsdp":
            return self.device_mesh["dp_replicate", "dp_shard"]
        if name == "dp" and self._dp_mesh is not None:
            self.device_mesh  # noqa: B018 (raises if the groups were destroyed)
            return self._dp_mesh
        return self.device_mesh[name]

    @classmethod
    def build(cls, layout: Layout, device_type: str, backend: str, timeout: timedelta) -> Par3DMesh:
        """Creates the ``DeviceMesh`` (and the flattened ``dp`` group) over the initialized default group. Every
        rank must call it (it creates process groups)."""
        from torch.distributed.device_mesh import init_device_mesh

        options = _backend_options(backend, timeout)
        override: Any = {name: (backend, options) for name in DIM_NAMES} if options is not None else None
        mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=DIM_NAMES, backend_override=override)
        dp = flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp", (backend, options) if options else None)
        return cls(layout, mesh, dp)

    def process_groups(self) -> list[Any]:
        """This rank's process groups of the mesh: one per dimension, and the flattened ``dp`` group."""
        if self._device_mesh is None or self.destroyed:
            return []
        mesh = self._device_mesh
        groups = [mesh.get_group(name) for name in DIM_NAMES]
        if self._dp_mesh is not None:
            groups.append(self._dp_mesh.get_group())
        unique: list[Any] = []
        for group in groups:
            if all(group is not seen for seen in unique):
                unique.append(group)
        return unique

    def destroy(self) -> None:
        """Destroys the mesh's process groups (never the default group) and releases their threads and sockets.
        Every rank of the world must call it at the same point, in the same order relative to other meshes."""
        import torch.distributed as dist

        if self.destroyed:
            return
        groups = self.process_groups()
        self.destroyed = True
        if not dist.is_initialized():
            return  # the world is gone, and every group with it
        for group in groups:
            if group is not dist.group.WORLD and _is_live(group):
                dist.destroy_process_group(group)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"Rank {rank} is outside the mesh of {self.layout.world_size} ranks ({self.layout}).")

    @staticmethod
    def _same_except(a: Coords, b: Coords, free: tuple[str, ...]) -> bool:
        return all(getattr(a, n) == getattr(b, n) for n in DIM_NAMES if n not in free)


def _is_live(group: Any) -> bool:
    """Whether ``group`` is still registered (not destroyed yet, by another mesh object over the same groups):
    ``get_backend`` refuses a group the world no longer knows."""
    import torch.distributed as dist

    try:
        dist.get_backend(group)
    except ValueError:
        return False
    return True


def _backend_options(backend: str, timeout: timedelta) -> Any:
    """Process-group options that carry ``timeout`` to the mesh's sub-groups (they default to 30 minutes)."""
    import torch.distributed as dist

    if backend == "gloo":
        # At run time this is Backend.Options(backend, timeout); torch's stub describes gloo's private _Options.
        return dist.ProcessGroupGloo.Options(backend, timeout)  # type: ignore[call-arg]
    if backend == "nccl" and dist.is_nccl_available():
        return nccl_options(timeout)
    return None
