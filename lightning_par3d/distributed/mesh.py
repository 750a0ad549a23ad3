"""The named device mesh: ``pp × dp_replicate × dp_shard × tp``, row-major, ``tp`` innermost. Under context
parallelism the ``dp_shard`` dimension holds ``dp_shard × cp`` ranks, ``cp`` inner (FSDP2 shards over both, as
torchtitan does); the ``cp`` ranks that split one set of rows have a group of their own.

:class:`Par3DMesh` answers layout questions (a rank's coordinates, the ranks of its groups, its pipeline neighbours)
with plain arithmetic, so it works and is tested without processes. :meth:`Par3DMesh.build` adds the real
``DeviceMesh`` once the default process group exists, from process groups that
:mod:`lightning_par3d.distributed.groups` owns (one per set of ranks, shared by every layout that has it, each with the
configured collective timeout) through torch's public ``DeviceMesh.from_group``; the flattened ``dp`` group too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_par3d.config import Layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Mesh dimension names, outermost first. Adjacent ranks differ in ``tp`` first, so tp stays inside a node."""

EXPERT_DIM_NAMES = ("pp", "dp_replicate", "expert_shard", "ep", "tp")
"""The experts' mesh under ``ep > 1``: ``dp_shard`` split into ``expert_shard × ep``, ``ep`` inner (adjacent
``dp_shard`` ranks exchange tokens). A second ``DeviceMesh`` over the same ranks, so that FSDP2 can shard the experts
over ``expert_shard`` while they are split over ``ep`` (both sub-meshes of one root, as FSDP2 needs)."""

GROUP_NAMES = (*DIM_NAMES, "dp", "cp")
"""Groups that :meth:`Par3DMesh.group_ranks` knows: each dimension, ``dp`` = ``dp_replicate × dp_shard`` (with the
context-parallel ranks: every rank whose gradients are summed), and ``cp``."""


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
        self,
        layout: Layout,
        device_mesh: DeviceMesh | None = None,
        dp_mesh: DeviceMesh | None = None,
        expert_mesh: DeviceMesh | None = None,
        cp_group: Any = None,
    ) -> None:
        self.layout = layout
        self._device_mesh = device_mesh
        self._dp_mesh = dp_mesh
        """The flattened ``dp`` mesh (``dp_replicate × dp_shard`` as one dimension)."""
        self._expert_mesh = expert_mesh
        """Under ``ep > 1``: the experts' mesh (:data:`EXPERT_DIM_NAMES`)."""
        self._cp_group = cp_group
        """Under ``cp > 1``: this rank's context-parallel process group."""
        self.destroyed = False

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layout.shape

    def coords(self, rank: int) -> Coords:
        """The (pp, dp_replicate, dp_shard, tp) coordinates of a global rank (``dp_shard`` counting the mesh's
        ``dp_shard × cp`` ranks)."""
        self._check_rank(rank)
        values = []
        for size in reversed(self.shape):
            values.append(rank % size)
            rank //= size
        pp, dp_replicate, dp_shard, tp = reversed(values)
        return Coords(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)

    def pipeline_ranks(self, pp_rank: int) -> tuple[int, ...]:
        """The global ranks of pipeline rank ``pp_rank`` (those whose :meth:`coords` have it): ``pp`` is the mesh's
        outermost dimension, so they are one contiguous block of ``world / pp`` ranks."""
        per = self.layout.world_size // self.layout.pp
        return tuple(range(pp_rank * per, (pp_rank + 1) * per))

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
        return c.dp_replicate * self.layout.dp_shard + c.dp_shard // self.layout.cp

    def cp_rank(self, rank: int) -> int:
        """The rank's index among the context-parallel ranks that split its rows (0 without cp)."""
        return self.coords(rank).dp_shard % self.layout.cp

    @property
    def cp_group(self) -> Any:
        """This rank's context-parallel process group (under ``cp > 1``, once built)."""
        self.device_mesh  # noqa: B018 (raises if the groups were destroyed)
        if self._cp_group is None:
            raise RuntimeError(f"The mesh has no context-parallel group: cp={self.layout.cp} ({self.layout}).")
        return self._cp_group

    def group_ranks(self, group: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``group`` (a dimension name, or ``dp``), in mesh order."""
        if group not in GROUP_NAMES:
            raise ValueError(f"Unknown mesh group {group!r}. Known: {', '.join(GROUP_NAMES)}.")
        if group == "cp":
            first = rank - self.cp_rank(rank) * self.layout.tp
            return [first + i * self.layout.tp for i in range(self.layout.cp)]
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
        if name in ("ep", "ep_tp", "expert_fsdp"):
            return self._expert_submesh(name)
        return self.device_mesh[name]

    def _expert_submesh(self, name: str) -> DeviceMesh:
        """``ep``: the ranks that split the experts; ``ep_tp``: those and the tp ranks that cut each expert (2D);
        ``expert_fsdp``: the mesh FSDP2 shards the experts over (the ``dp_shard`` ranks that hold the same experts,
        2D with ``dp_replicate`` under HSDP)."""
        self.device_mesh  # noqa: B018 (raises if the groups were destroyed)
        if self._expert_mesh is None:
            raise RuntimeError(f"The mesh has no experts' dimensions: ep={self.layout.ep} ({self.layout}).")
        if name == "ep":
            return self._expert_mesh["ep"]
        if name == "ep_tp":
            return self._expert_mesh["ep", "tp"]
        if self.layout.dp_replicate == 1:
            return self._expert_mesh["expert_shard"]
        return self._expert_mesh["dp_replicate", "expert_shard"]

    def all_group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of each kind in :data:`GROUP_NAMES`, as its ranks in mesh order: the whole partition of the
        world along that dimension (``dp``: along ``dp_replicate`` and ``dp_shard`` together)."""
        import torch

        ranks = torch.arange(self.layout.world_size).reshape(self.shape)
        found = {name: ranks.movedim(i, -1).reshape(-1, ranks.shape[i]).tolist() for i, name in enumerate(DIM_NAMES)}
        found["dp"] = ranks.permute(0, 3, 1, 2).reshape(-1, self.layout.dp_cp).tolist()
        if self.layout.ep > 1:
            experts = ranks.reshape(self.expert_shape)
            for name in ("expert_shard", "ep"):
                i = EXPERT_DIM_NAMES.index(name)
                found[name] = experts.movedim(i, -1).reshape(-1, experts.shape[i]).tolist()
        if self.layout.cp > 1:
            layout = self.layout
            context = ranks.reshape(layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
            found["cp"] = context.movedim(3, -1).reshape(-1, layout.cp).tolist()
        return found

    @property
    def expert_shape(self) -> tuple[int, int, int, int, int]:
        """The experts' mesh shape, :data:`EXPERT_DIM_NAMES`."""
        layout = self.layout
        return (layout.pp, layout.dp_replicate, layout.expert_shard, layout.ep, layout.tp)

    @classmethod
    def build(cls, layout: Layout, device_type: str, group_of: Callable[[list[int]], Any]) -> Par3DMesh:
        """Creates the ``DeviceMesh`` and the flattened ``dp`` mesh over the initialized default group.

        ``group_of(ranks)`` gives the process group of a set of ranks (:func:`lightning_par3d.distributed.groups.
        group_of` creates it once and keeps it). Every rank calls it for every group of the layout, its own or not,
        in the same order, as torch's ``new_group`` needs; the mesh holds the ones this rank belongs to."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        rank = dist.get_rank()
        arithmetic = cls(layout)
        mine: dict[str, tuple[Any, list[int]]] = {}
        for name, sets in arithmetic.all_group_ranks().items():
            for ranks in sets:
                group = group_of(ranks)
                if rank in ranks:
                    mine[name] = (group, ranks)
        every_rank = torch.arange(layout.world_size).reshape(layout.shape)
        dims = [mine[name][0] for name in DIM_NAMES]
        mesh = DeviceMesh.from_group(dims, device_type, mesh=every_rank, mesh_dim_names=DIM_NAMES)
        dp_group, dp_ranks = mine["dp"]
        dp = DeviceMesh.from_group(dp_group, device_type, mesh=dp_ranks, mesh_dim_names=("dp",))
        experts = None
        if layout.ep > 1:
            groups = [mine[name][0] for name in EXPERT_DIM_NAMES]
            shape = arithmetic.expert_shape
            experts = DeviceMesh.from_group(
                groups, device_type, mesh=every_rank.reshape(shape), mesh_dim_names=EXPERT_DIM_NAMES
            )
        cp_group = mine["cp"][0] if layout.cp > 1 else None
        return cls(layout, mesh, dp, experts, cp_group)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"Rank {rank} is outside the mesh of {self.layout.world_size} ranks ({self.layout}).")

    @staticmethod
    def _same_except(a: Coords, b: Coords, free: tuple[str, ...]) -> bool:
        return all(getattr(a, n) == getattr(b, n) for n in DIM_NAMES if n not in free)
