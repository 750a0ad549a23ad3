"""The memory summary table, CSV and plot, from :class:`~lightning_par3d.callbacks.memory_stats.MemoryRecord` rows."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

KINDS = ("params", "grads", "optimizer", "activations")
COLORS = {"params": "#4C72B0", "grads": "#55A868", "optimizer": "#C44E52", "activations": "#8172B3"}
MIB = 2**20


def _by_rank(records: Sequence[Any]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for record in records:
        out.setdefault(record.rank, []).append(record)
    return {rank: sorted(rows, key=lambda r: r.step) for rank, rows in sorted(out.items())}


def _estimate_row(estimate: Any, pp_rank: int) -> Any:
    if estimate is None:
        return None
    return next((row for row in estimate.rows if row.pp_rank == pp_rank), None)


def format_summary(records: Sequence[Any], estimate: Any) -> str:
    """Per rank: the peak of each kind over the run (MiB); the largest step total and the median one, beside the
    estimate (which predicts the median: a steady step); the CUDA allocator's peak where there is one."""
    cuda = any(r.cuda_peak for r in records)
    head = "| rank | pp | params | grads | optimizer | activations | largest step | median step | estimate |" + (
        " CUDA peak |" if cuda else ""
    )
    lines = ["par3d memory per rank (MiB)", "", head, "|" + "---:|" * (head.count("|") - 1)]
    for rank, rows in _by_rank(records).items():
        peaks = [f"{max(getattr(r, f'{kind}_peak') for r in rows) / MIB:.2f}" for kind in KINDS]
        totals = sorted(r.total_peak for r in rows)
        estimated = _estimate_row(estimate, rows[0].pp_rank)
        guess = f"{estimated.total / MIB:.2f}" if estimated is not None else "—"
        cells = [str(rank), str(rows[0].pp_rank), *peaks]
        cells += [f"{totals[-1] / MIB:.2f}", f"{totals[len(totals) // 2] / MIB:.2f}", guess]
        if cuda:
            cells.append(f"{max(r.cuda_peak for r in rows) / MIB:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.pp_rank for r in records):
        lines.append(
            "(Under pipelining the first step, and the first after each validation, hold more: torch's pipeline "
            "stages run one extra forward and backward then to infer shapes.)"
        )
    return "\n".join(lines)


def write_csv(records: Sequence[Any], path: Path) -> Path:
    """Every rank's figures at every step, one row each (bytes)."""
    rows = [asdict(r) for r in sorted(records, key=lambda r: (r.step, r.rank))]
    if rows:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def plot_memory(records: Sequence[Any], estimate: Any, path: Path) -> Path:
    """One panel per rank: memory over steps, stacked by kind (the step's peaks, MiB); a dashed line for the
    estimator's total for that rank, and the CUDA allocator's peak where there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = _by_rank(records)
    columns = min(len(ranks), 4)
    lines = -(-len(ranks) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(3.6 * columns, 2.6 * lines + 0.8), sharex=True, squeeze=False)
    top = max((r.total_peak for r in records), default=1) / MIB
    if estimate is not None:
        top = max(top, max(row.total for row in estimate.rows) / MIB)
    for ax, (rank, rows) in zip(axes.flat, ranks.items(), strict=False):
        steps = [r.step for r in rows]
        layers = [[getattr(r, f"{kind}_peak") / MIB for r in rows] for kind in KINDS]
        ax.stackplot(steps, layers, labels=KINDS, colors=[COLORS[k] for k in KINDS], alpha=0.85)
        estimated = _estimate_row(estimate, rows[0].pp_rank)
        if estimated is not None:
            ax.axhline(estimated.total / MIB, color="black", linestyle="--", linewidth=1, label="estimate")
        if any(r.cuda_peak for r in rows):
            ax.plot(steps, [r.cuda_peak / MIB for r in rows], color="black", linewidth=1, label="CUDA peak")
        ax.set_title(f"rank {rank} (pp {rows[0].pp_rank})", fontsize=9)
        ax.set_ylim(0, top * 1.1)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(ranks) :]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("MiB", fontsize=8)
    for ax in axes[-1, :]:
        ax.set_xlabel("step", fontsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("memory per rank over training steps (peak of each step, stacked by kind)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
