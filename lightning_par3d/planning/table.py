"""A plan's result: one :class:`PlanRow` per candidate layout, ranked in a :class:`PlanTable`, and its text (a
markdown table; :mod:`~lightning_par3d.planning.plot` draws it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lightning_par3d.config import Layout, Par3DConfig
from lightning_par3d.memory.estimate import MemoryEstimate
from lightning_par3d.planning.cost import StepTime
from lightning_par3d.planning.machine import Machine, format_bytes


@dataclass(frozen=True)
class PlanRow:
    """One candidate: its configuration, and either its memory and predicted step, or why it cannot run."""

    config: Par3DConfig
    layout: Layout | None
    memory: MemoryEstimate | None = None
    """The estimator's figures for this layout (None where the layout was rejected before)."""
    time: StepTime | None = None
    fits: bool = False
    reason: str | None = None
    """Why the layout cannot run here (None for a layout that fits)."""
    samples: int | None = None
    """Samples a step takes at this layout (over every data-parallel rank), where its step was predicted."""
    rank_batch: int | None = None
    """Samples per data-parallel rank in each batch, where the step was predicted."""
    accumulate: int = 1
    """Batches accumulated into one optimizer step (``accumulate_grad_batches``)."""

    @property
    def peak_memory(self) -> int | None:
        return self.memory.peak if self.memory is not None else None

    @property
    def step_s(self) -> float | None:
        return self.time.total if self.time is not None else None

    @property
    def samples_per_s(self) -> float | None:
        """Predicted throughput: the step's samples over its time."""
        if self.time is None or not self.samples or self.time.total <= 0:
            return None
        return self.samples / self.time.total

    def describe(self) -> str:
        """The layout in one short line: sizes, ZeRO stage, schedule and checkpointing."""
        c = self.config
        layout = self.layout
        source = layout if layout is not None else c
        within = _within(source, "·{name}{size}")
        sizes = f"pp{source.pp}·rep{source.dp_replicate}·shard{source.dp_shard}{within}·tp{source.tp}"
        parts = [sizes, f"z{_zero(self)}"]
        if c.pp > 1:
            v = f" v{c.virtual_stages}" if c.virtual_stages > 1 else ""
            parts.append(f"{c.pipeline_schedule}{v} m{c.microbatches}")
        if c.activation_checkpointing != "none":
            parts.append(f"ac={c.activation_checkpointing}")
        if self.accumulate > 1:
            parts.append(f"batch {self.rank_batch}×acc{self.accumulate}")
        return " ".join(parts)

    def strategy_arguments(self) -> dict[str, Any]:
        """The ``Par3DConfig`` / ``Par3DStrategy`` keyword arguments that select this layout."""
        c = self.config
        layout = self.layout
        args: dict[str, Any] = {}
        if layout is not None:
            args.update(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp)
            args["zero_stage"] = layout.zero
            args.update({name: getattr(layout, name) for name in ("cp", "ep") if getattr(layout, name) > 1})
        if c.pp > 1:
            args.update(pipeline_schedule=c.pipeline_schedule, microbatches=c.microbatches)
            if c.virtual_stages != 1:
                args["virtual_stages"] = c.virtual_stages
        if c.activation_checkpointing != "none":
            args["activation_checkpointing"] = c.activation_checkpointing
        return args


def _within(source: Any, form: str) -> str:
    """The context- and expert-parallel degrees of a layout (or a configuration) above 1, each as ``form``
    (``"·{name}{size}"``, ``" × {name}={size}"``)."""
    return "".join(form.format(name=n, size=getattr(source, n)) for n in ("cp", "ep") if getattr(source, n) > 1)


def _zero(row: PlanRow) -> int:
    if row.layout is not None:
        return row.layout.zero
    return row.config.zero_stage or 0


def _pipeline_size(layout: Layout) -> int:
    return layout.pp


def _engine(layout: Layout) -> tuple[str, int]:
    return layout.data_parallel, layout.zero


def _tensor_size(layout: Layout) -> int:
    return layout.tp


def layout_kind(layout: Layout) -> tuple[int, int, str]:
    """A layout's kind: its pipeline and tensor-parallel sizes and its data-parallel engine (DDP, par3d's ZeRO-1/2,
    FSDP2). The cost model's errors are systematic by kind: on the 2-core machine of ``benchmarks/bench_planner.py``
    it underestimated every ZeRO-2 layout (measured / predicted 1.05–1.16 at 8 ranks) and overestimated every
    pipelined one (0.78–0.88), so the layouts of one kind are ranked right among themselves and wrong against
    another kind."""
    return (layout.pp, layout.tp, layout.data_parallel)


def to_measure(fitting: list[PlanRow], count: int) -> list[PlanRow]:
    """What ``layout="auto"`` measures among ``fitting`` (fastest predicted first), at most ``count``: the plan's first
    choice, then the fastest predicted layout at each pipeline size not yet measured (``pp=1`` included), then of
    each data-parallel engine and ZeRO stage, then at each tensor-parallel size, then of each other kind
    (:func:`layout_kind`), then the next fastest layouts; measured fastest predicted first.

    The cost model's errors are systematic, most by pipeline size, then by engine and ZeRO stage: on a tiny untied
    Qwen2 at 4 ranks it put a pipeline first in each of its five fastest predictions, while plain replication
    measured fastest (by 1.22×), and taking the ``count`` fastest kinds measured three pipelines at pp=2; on
    ``bench_planner``'s measurements it predicts pipelines 12–22 % too slow and ZeRO-2 5–16 % too fast, and
    tensor-parallel layouts, 2× slower on CPU cores, were never the fastest. Replayed on one full ``bench_planner``
    run (2026-11-28, three models and a held-out Qwen3 at 4 and 8 ranks), this order takes the choice within 7 % of
    the best measured layout in all eight cases, where the fastest kinds missed by 9 % and 20 %
    (docs/benchmarks.md)."""
    if count <= 0 or not fitting:
        return []
    layouts = [row.layout for row in fitting if row.layout is not None]
    assert len(layouts) == len(fitting), "a fitting row has a layout"
    picked: list[int] = [0]
    axes = (_pipeline_size, _engine, _tensor_size, layout_kind)
    for axis in axes:
        seen = {axis(layouts[index]) for index in picked}
        for index, layout in enumerate(layouts):
            if len(picked) >= count:
                break
            value = axis(layout)
            if value not in seen:
                seen.add(value)
                picked.append(index)
    rest = [index for index in range(len(fitting)) if index not in picked]
    return [fitting[index] for index in sorted(picked + rest[: max(count - len(picked), 0)])]


@dataclass
class PlanTable:
    """Every candidate of a plan: the layouts that fit, fastest first, then those that do not fit (by memory),
    then those rejected before (each with its reason)."""

    rows: list[PlanRow]
    world_size: int
    devices_per_node: int
    device_memory: int
    batch: str
    """The batch of a step, in words: ``"global batch 16"`` or ``"4 per data-parallel rank"``."""
    seq_len: int
    precision: str
    machine: Machine
    model: str = ""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rows = sorted(self.rows, key=rank_key)

    def __iter__(self) -> Iterator[PlanRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fitting(self) -> list[PlanRow]:
        """The layouts that fit, fastest first."""
        return [row for row in self.rows if row.fits]

    @property
    def rejected(self) -> list[PlanRow]:
        """The layouts that cannot run here, each with its reason."""
        return [row for row in self.rows if not row.fits]

    def to_measure(self, count: int) -> list[PlanRow]:
        """The ``count`` fitting layouts ``layout="auto"`` measures (:func:`to_measure`)."""
        return to_measure(self.fitting, count)

    @property
    def best(self) -> PlanRow:
        """The fastest layout that fits."""
        if not self.fitting:
            raise ValueError("No layout of this plan fits; see each row's reason.")
        return self.fitting[0]

    def to_markdown(self, top: int | None = None, group_rejected: bool = False) -> str:
        """The ranked table: the ``top`` fitting layouts (None: all), then every rejected one with its reason, a
        line each, or with ``group_rejected`` a line per reason listing its layouts."""
        return markdown(self, top, group_rejected)

    def __str__(self) -> str:
        return self.to_markdown()

    def memory_text(self, row: PlanRow) -> str:
        return format_bytes(row.peak_memory) if row.peak_memory is not None else "—"


def rank_key(row: PlanRow) -> tuple[int, float, str]:
    """Fitting layouts by time per sample (at one global batch, by step time), then by memory, then the rest."""
    if row.fits and row.time is not None:
        return (0, row.time.total / (row.samples or 1), row.describe())
    if row.memory is not None:
        return (1, float(row.memory.peak), row.describe())
    return (2, 0.0, row.describe())


# ---------------------------------------------------------------- as text


def header(table: PlanTable) -> str:
    return (
        f"par3d plan: {table.model or 'the model'} on {table.world_size} ranks ({table.devices_per_node} per node), "
        f"{format_bytes(table.device_memory)} per device, {table.batch} × {table.seq_len} tokens, "
        f"{table.precision}\nmachine: {table.machine.describe()}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f}" if seconds < 1 else f"{seconds * 1e3:,.1f}"


def markdown(table: PlanTable, top: int | None = None, group_rejected: bool = False) -> str:
    """Two tables: the layouts that fit, fastest first, with their predicted step split into buckets; then the
    rejected ones, each with its reason (``group_rejected``: one line per reason, with its layouts)."""
    lines = [header(table), ""]
    fitting = table.fitting if top is None else table.fitting[:top]
    lines += [
        f"Layouts that fit ({len(table.fitting)}), fastest first; step time predicted (ms), memory per rank from "
        "estimate_memory:",
        "",
        "| # | layout | ZeRO | schedule | ac | memory/rank | step ms | samples/s | compute | tp comm | dp comm | "
        "bubble |",
        "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_fit_line(i, row, table) for i, row in enumerate(fitting, 1)]
    if len(fitting) < len(table.fitting):
        lines.append(f"| … | {len(table.fitting) - len(fitting)} more | | | | | | | | | | |")
    if not fitting:
        lines.append("| — | none fits | | | | | | | | | | |")
    if table.rejected:
        lines += ["", f"Rejected layouts ({len(table.rejected)}):", ""]
        lines += _grouped(table) if group_rejected else _each(table)
    if table.notes:
        lines += ["", *table.notes]
    return "\n".join(lines)


def _each(table: PlanTable) -> list[str]:
    lines = ["| layout | ZeRO | schedule | ac | memory/rank | why |", "|---|---:|---|---|---:|---|"]
    for row in table.rejected:
        lines.append(
            f"| {_sizes(row)} | {_zero_text(row)} | {_schedule(row)} | {row.config.activation_checkpointing} | "
            f"{table.memory_text(row)} | {row.reason or ''} |"
        )
    return lines


def _grouped(table: PlanTable, shown: int = 3) -> list[str]:
    """A line per reason. The layouts that do not fit in memory (each with its own figures in its reason) share one
    line, closest first, with the range of what they need: a real-sized model's plan rejects thousands of them."""
    needed = {id(row): row.peak_memory for row in table.rejected if row.peak_memory is not None}
    too_big = sorted((row for row in table.rejected if id(row) in needed), key=lambda row: needed[id(row)])
    groups: dict[str, list[PlanRow]] = {}
    if too_big:
        least, most = format_bytes(needed[id(too_big[0])]), format_bytes(needed[id(too_big[-1])])
        groups[f"needs more than the {format_bytes(table.device_memory)} of a device ({least} to {most})"] = too_big
    for row in table.rejected:
        if id(row) not in needed:
            groups.setdefault(row.reason or "", []).append(row)
    lines = ["| why | layouts |", "|---|---|"]
    for reason, rows in groups.items():
        names = "; ".join(row.describe() for row in rows[:shown])
        more = f"; and {len(rows) - shown} more" if len(rows) > shown else ""
        lines.append(f"| {reason} | {len(rows)}: {names}{more} |")
    return lines


def _fit_line(i: int, row: PlanRow, table: PlanTable) -> str:
    t = row.time
    assert t is not None
    return (
        f"| {i} | {_sizes(row)} | {_zero_text(row)} | {_schedule(row)} | {row.config.activation_checkpointing} | "
        f"{table.memory_text(row)} | {_ms(t.total)} | {_rate(row.samples_per_s)} | {_ms(t.compute)} | "
        f"{_ms(t.tp_comm)} | {_ms(t.dp_comm)} | {_ms(t.bubble)} |"
    )


def _rate(per_s: float | None) -> str:
    return "—" if per_s is None else f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:,.2f}"


def _sizes(row: PlanRow) -> str:
    source = row.layout if row.layout is not None else row.config
    within = _within(source, " × {name}={size}")
    return f"pp={source.pp} × rep={source.dp_replicate} × shard={source.dp_shard}{within} × tp={source.tp}"


def _zero_text(row: PlanRow) -> str:
    if row.layout is not None:
        return str(row.layout.zero) if row.layout.dp_cp > 1 else "—"
    return str(row.config.zero_stage) if row.config.zero_stage is not None else "—"


def _schedule(row: PlanRow) -> str:
    c = row.config
    if c.pp == 1:
        return "—"
    v = f", v={c.virtual_stages}" if c.virtual_stages > 1 else ""
    return f"{c.pipeline_schedule} (m={c.microbatches}{v})"
