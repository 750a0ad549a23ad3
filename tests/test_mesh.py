"""The mesh's rank arithmetic, without processes."""

from __future__ import annotations

import pytest

from lightning_par3d import Layout, Par3DMesh
from lightning_par3d.distributed.mesh import Coords

MESH = Par3DMesh(Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2))  # 16 ranks


def test_coords_are_row_major_with_tp_innermost():
    assert MESH.coords(0) == Coords(0, 0, 0, 0)
    assert MESH.coords(1) == Coords(0, 0, 0, 1)
    assert MESH.coords(2) == Coords(0, 0, 1, 0)
    assert MESH.coords(4) == Coords(0, 1, 0, 0)
    assert MESH.coords(8) == Coords(1, 0, 0, 0)
    assert MESH.coords(15) == Coords(1, 1, 1, 1)


def test_rank_of_inverts_coords():
    assert [MESH.rank_of(MESH.coords(r)) for r in range(16)] == list(range(16))


@pytest.mark.parametrize(
    "layout",
    [
        Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2),
        Layout(4, 1, 2, 1, cp=2),
        Layout(pp=1, dp_replicate=1, dp_shard=1, tp=4),
    ],
)
def test_pipeline_ranks_are_the_ranks_whose_coords_have_that_pp_rank(layout):
    mesh = Par3DMesh(layout)
    for pp_rank in range(layout.pp):
        assert mesh.pipeline_ranks(pp_rank) == tuple(
            r for r in range(layout.world_size) if mesh.coords(r).pp == pp_rank
        )


def test_groups():
    assert MESH.group_ranks("tp", 5) == [4, 5]
    assert MESH.group_ranks("dp_shard", 5) == [5, 7]
    assert MESH.group_ranks("dp_replicate", 5) == [1, 5]
    assert MESH.group_ranks("dp", 5) == [1, 3, 5, 7]
    assert MESH.group_ranks("pp", 5) == [5, 13]


def test_dp_rank_orders_replicas_then_shards():
    assert [MESH.dp_rank(r) for r in (0, 1, 2, 3, 4, 6, 8)] == [0, 0, 1, 1, 2, 3, 0]


def test_bad_queries_raise():
    with pytest.raises(ValueError, match="Rank 16 is outside the mesh of 16 ranks"):
        MESH.coords(16)
    with pytest.raises(ValueError, match="Unknown mesh group 'sp'"):
        MESH.group_ranks("sp", 0)
    with pytest.raises(ValueError, match="Coordinate tp=2 is outside the mesh"):
        MESH.rank_of(Coords(0, 0, 0, 2))
    with pytest.raises(RuntimeError, match="exists only after the processes have initialized"):
        _ = MESH.device_mesh
