"""A plan as a picture: the predicted step of its best layouts as stacked bars."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lightning_par3d.planning.cost import BUCKETS

if TYPE_CHECKING:
    from lightning_par3d.planning.table import PlanTable

BUCKET_LABELS = ("compute", "tensor-parallel comm", "data-parallel comm", "pipeline bubble")
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


def plot(table: PlanTable, path: str, top: int = 20) -> str:
    """Horizontal stacked bars of the predicted step (compute, tp comm, dp comm, bubble) of the ``top`` fitting
    layouts, fastest at the top; written with matplotlib's Agg backend. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table.fitting[:top]
    if not rows:
        raise ValueError("No layout fits, so there is nothing to plot; see the table's reasons.")
    scale, unit = (1e3, "ms") if rows[-1].step_s and rows[-1].step_s < 1 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.42 * len(rows)))
    labels = [f"{i}. {row.describe()}" for i, row in enumerate(rows, 1)]
    positions = list(range(len(rows)))[::-1]
    left = [0.0] * len(rows)
    for bucket, label, color in zip(BUCKETS, BUCKET_LABELS, COLORS, strict=True):
        values = [getattr(row.time, bucket) * scale for row in rows]
        ax.barh(positions, values, left=left, color=color, label=label, height=0.7)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for y, total in zip(positions, left, strict=True):
        ax.text(total, y, f" {total:,.2f}", va="center", fontsize=8)
    ax.set_yticks(positions)
    ax.set_yticklabels(labels, fontsize=8, family="monospace")
    ax.set_xlabel(f"predicted step time ({unit})")
    ax.set_xlim(0, max(left) * 1.15)
    ax.set_title(
        f"{table.model or 'model'}: {table.world_size} ranks, {table.batch} × {table.seq_len} tokens, "
        f"{table.precision} — machine {table.machine.name}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8, ncols=4, bbox_to_anchor=(1.0, 1.04), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
