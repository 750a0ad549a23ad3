"""The bottleneck report's suggestions follow the layout they are about."""

from __future__ import annotations

from lightning_par3d.callbacks.bottleneck.analysis import StepTimes
from lightning_par3d.callbacks.bottleneck.findings import BUCKETS, RankSummary, ReportContext, diagnose, suggest
from lightning_par3d.config import Layout


def test_optimizer_suggestion_under_tensor_parallelism_without_fsdp():
    """Without ZeRO-3, tensor-parallel and plain parameters share the optimizer's groups, which par3d runs on the
    per-tensor path: "use a foreach optimizer" cannot help there, sharding the parameters can."""
    tp_only = suggest("optimizer", 0.2, ReportContext(layout=Layout(1, 1, 1, 2)))
    assert "ZeRO-3 (dp_shard > 1)" in tp_only and "use a foreach" not in tp_only
    fsdp_tp = suggest("optimizer", 0.2, ReportContext(layout=Layout(1, 1, 2, 2)))
    assert "use a foreach/fused optimizer" in fsdp_tp


def test_the_findings_rank_the_buckets_by_their_share_of_the_step():
    """Fixed buckets (what a slow dataloader gives: 0.8 s of a 1 s step waiting for data) rank the dataloader
    first, at its mean share over the ranks, with its severity and its fix; compute is no finding."""

    def rank(r: int, loader_us: float) -> RankSummary:
        buckets = dict.fromkeys(BUCKETS, 0.0)
        buckets.update(dataloader=loader_us, forward=60e3, backward=100e3, optimizer=1e6 - loader_us - 160e3)
        return RankSummary(rank=r, pp_rank=0, step=StepTimes(cycle_us=1e6, buckets=buckets))

    findings = diagnose([rank(0, 0.8e6), rank(1, 0.7e6)], ReportContext(layout=Layout(1, 1, 2, 1), num_workers=0))
    top, second = findings[0], findings[1]
    assert (top.bucket, round(top.fraction, 6), round(top.worst_fraction, 6)) == ("dataloader", 0.75, 0.8)
    assert top.severity in ("high", "critical") and "raise num_workers (now 0)" in top.suggestion
    assert second.bucket == "optimizer" and round(second.fraction, 6) == 0.09
    assert not {"forward", "backward"} & {f.bucket for f in findings}
