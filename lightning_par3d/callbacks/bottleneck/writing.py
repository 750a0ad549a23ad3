"""The report's files and its console lines: ``bottleneck_report.md``, ``pipeline_timeline.png`` and the short
version rank 0 prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_par3d.callbacks.bottleneck.findings import RankSummary, ReportContext, render_markdown, short_summary
from lightning_par3d.callbacks.bottleneck.timeline import plot_timeline


def write_report(
    directory: Path,
    everyone: list[dict[str, Any]],
    summaries: list[RankSummary],
    findings: list[Any],
    context: ReportContext,
    advice: list[Any],
    advice_error: str | None,
) -> tuple[Path, Path | None]:
    """Writes the Markdown report and the timeline of the last sampled step into ``directory``; their paths."""
    report = directory / "bottleneck_report.md"
    report.write_text(render_markdown(summaries, findings, context, advice, advice_error))
    rows = [(f"rank {r['rank']} (pp {r['pp_rank']})", r["blocks"]) for r in everyone]
    return report, plot_timeline(rows, directory / "pipeline_timeline.png", timeline_title(context))


def console_summary(
    summaries: list[RankSummary],
    findings: list[Any],
    context: ReportContext,
    advice: list[Any],
    advice_error: str | None,
    report: Path,
    traces: str,
    trace: Path,
) -> str:
    """What rank 0 prints at the end of fit: the short report, where the full one is, and which traces were kept."""
    summary = short_summary(summaries, findings, context, advice, advice_error)
    kept = {"rank0": f"rank 0's Chrome trace: {trace} (traces='all' keeps every rank's)",
            "all": f"Chrome traces: {trace.parent}/trace_rank*.json", "none": ""}[traces]  # fmt: skip
    return summary + f"\n  full report: {report}" + (f"\n  {kept}" if kept else "")


def timeline_title(context: ReportContext) -> str:
    layout = context.layout
    if layout is not None and layout.pp > 1:
        return f"{context.schedule}, pp={layout.pp}, {context.microbatches} microbatches: last sampled step"
    return f"{layout}: last sampled step"
