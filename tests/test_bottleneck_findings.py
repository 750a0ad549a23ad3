"""The bottleneck report's suggestions follow the layout they are about."""

from __future__ import annotations

from lightning_par3d.callbacks.bottleneck.findings import ReportContext, suggest
from lightning_par3d.config import Layout


def test_optimizer_suggestion_under_tensor_parallelism_without_fsdp():
    """Without ZeRO-3, tensor-parallel and plain parameters share the optimizer's groups, which par3d runs on the
    per-tensor path: "use a foreach optimizer" cannot help there, sharding the parameters can."""
    tp_only = suggest("optimizer", 0.2, ReportContext(layout=Layout(1, 1, 1, 2)))
    assert "ZeRO-3 (dp_shard > 1)" in tp_only and "use a foreach" not in tp_only
    fsdp_tp = suggest("optimizer", 0.2, ReportContext(layout=Layout(1, 1, 2, 2)))
    assert "use a foreach/fused optimizer" in fsdp_tp
