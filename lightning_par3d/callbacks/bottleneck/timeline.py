"""The pipeline timeline picture: one row per rank, each compute block as measured, the idle gaps left blank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

COLORS = {
    "F": "#4C72B0",  # forward of one microbatch on one stage
    "B": "#55A868",  # full backward
    "I": "#8FD19E",  # input-gradient backward (zero-bubble)
    "W": "#DD8452",  # weight-gradient backward (zero-bubble)
    "forward": "#4C72B0",
    "backward": "#55A868",
    "optimizer": "#937860",
    "tp_comm": "#8172B3",
    "dp_comm": "#C44E52",
    "pipeline": "#BBBBBB",
    "dataloader": "#CCB974",
}
LEGEND = {
    "F": "forward (microbatch)",
    "B": "backward",
    "I": "backward, input grads",
    "W": "backward, weight grads",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "tp_comm": "tp collective",
    "dp_comm": "dp collective",
    "pipeline": "send/recv",
    "dataloader": "dataloader",
}


@dataclass(frozen=True)
class Block:
    """One measured interval on one rank: its kind (a key of :data:`COLORS`), a label, absolute µs."""

    kind: str
    label: str
    start: float
    end: float


def plot_timeline(rows: Sequence[tuple[str, Sequence[Block]]], path: Path, title: str) -> Path:
    """Draws ``rows`` (a name and its blocks, top to bottom) on one time axis (ms from the earliest block) and
    writes a PNG. White between blocks is time the rank spent on none of them: the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    starts = [b.start for _, blocks in rows for b in blocks]
    origin = min(starts) if starts else 0.0
    end = max((b.end for _, blocks in rows for b in blocks), default=origin + 1.0)
    span_ms = max((end - origin) / 1e3, 1e-3)
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.6))
    used: dict[str, None] = {}
    for y, (_, blocks) in enumerate(rows):
        for block in blocks:
            left, width = (block.start - origin) / 1e3, (block.end - block.start) / 1e3
            color = COLORS.get(block.kind, "#999999")
            ax.broken_barh([(left, width)], (y - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.4)
            used[block.kind] = None
            if block.label and width > span_ms * 0.025:
                ax.text(left + width / 2, y, block.label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(
        handles=[Patch(color=COLORS.get(k, "#999999"), label=LEGEND.get(k, k)) for k in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if len(rows) < 4 else -0.12),
        ncol=min(len(used), 6),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
