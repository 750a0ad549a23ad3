"""Which groups of a layout cross nodes, and how many devices a node has, as the launcher says."""

from __future__ import annotations

import pytest

from lightning_par3d.config import Layout
from lightning_par3d.distributed.locality import launcher_devices_per_node, spans_nodes, tp_across_nodes


def test_groups_cross_nodes_as_the_row_major_mesh_puts_them():
    hsdp = Layout(pp=1, dp_replicate=2, dp_shard=4, tp=1).shape
    assert not spans_nodes(hsdp, "dp_shard", 4) and spans_nodes(hsdp, "dp_replicate", 4)
    staged = Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2).shape
    assert spans_nodes(staged, "pp", 4) and not spans_nodes(staged, "tp", 4) and not spans_nodes(staged, "dp", 4)
    assert not spans_nodes(Layout(pp=1, dp_replicate=1, dp_shard=1, tp=8).shape, "tp", 8)  # one node holds it all


def test_tp_across_nodes_names_the_cost_and_the_fix():
    assert tp_across_nodes(Layout(pp=1, dp_replicate=1, dp_shard=2, tp=4), 4) is None
    message = tp_across_nodes(Layout(pp=1, dp_replicate=1, dp_shard=2, tp=8), 4)
    assert message is not None
    assert "tp=8 puts tensor-parallel groups across nodes of 4 devices each" in message
    assert "Keep tp a divisor of 4 (tp=4)" in message
    assert tp_across_nodes(Layout(pp=1, dp_replicate=1, dp_shard=4, tp=3), 4) is not None  # 3 does not divide 4


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LOCAL_WORLD_SIZE": "4", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8"}, 4),  # torchrun inside SLURM
        ({"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8(x2)"}, 8),
        ({"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "8"}, 8),
        ({}, 16),
    ],
)
def test_devices_per_node_come_from_the_launcher(monkeypatch, env, expected):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launcher_devices_per_node(16) == expected
