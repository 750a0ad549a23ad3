"""``plan(...)``: every layout par3d accepts for a model and a world, with each one's memory and predicted step.

For each candidate of :mod:`~lightning_par3d.planning.candidates`, in order, the first reason it cannot run wins:

1. :func:`~lightning_par3d.config.resolve_layout` refuses it (its message), or its tensor-parallel groups would cross
   nodes, or the global batch does not split over its data-parallel ranks (or the per-rank batch into its
   microbatches);
2. the model cannot take it: par3d's own checks of the stage split and of the tensor-parallel plan raise (their
   message), or the precision does not go with its ZeRO stage;
3. its memory (:mod:`~lightning_par3d.planning.candidate_memory`: :func:`~lightning_par3d.estimate_memory`'s
   figures) is more than ``device_memory`` on some rank.

Expert-parallel degrees are searched for a model with experts (:mod:`~lightning_par3d.planning.expert_search`);
context-parallel layouts after the others, where these leave activations dominant
(:mod:`~lightning_par3d.planning.context_search`).

Every candidate that gets as far as its memory also gets a predicted step (:mod:`~lightning_par3d.planning.cost`).
The per-layout work is shared: the model is probed once per pipeline split and tensor-parallel degree, the
estimator runs once per class of layouts whose activations agree, and torch's schedules are built once each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.distributed.fakeworld import check_no_process_group, collector_paused, keep_excepthook
from lightning_par3d.planning.candidate_memory import MemoryModel
from lightning_par3d.planning.candidates import SearchSpace, candidates, check_fixed, rejection
from lightning_par3d.planning.context_search import context_degrees, context_may_pay, context_refusal
from lightning_par3d.planning.cost import StepTime, predict_step
from lightning_par3d.planning.expert_search import expert_degrees
from lightning_par3d.planning.machine import Machine, format_bytes, machine_profile, parse_bytes
from lightning_par3d.planning.probe import (
    ProbedByDepth,
    StageParams,
    StageWork,
    build_meta,
    probe_layout,
    stage_params,
    stage_work,
)
from lightning_par3d.planning.table import PlanRow, PlanTable

DEFAULT_MACHINE = "h100-sxm-8"
PRUNED = (
    "fits without activation checkpointing, which would only add recompute (SearchSpace(prune_checkpointing=False) "
    "lists it)"
)


def plan(
    module: nn.Module | Callable[[], nn.Module],
    world_size: int,
    devices_per_node: int | None = None,
    device_memory: int | float | str | None = None,
    *,
    global_batch: int | None = None,
    seq_len: int,
    rank_batch: int | None = None,
    precision: str = "32-true",
    machine: Machine | str = DEFAULT_MACHINE,
    fixed: Mapping[str, Any] | None = None,
    search: SearchSpace | None = None,
    base: Par3DConfig | None = None,
    optimizer: str = "adamw",
    loss_fn: Callable[..., Tensor] | None = None,
    accumulate: bool = False,
) -> PlanTable:
    """Every candidate layout of ``module`` on ``world_size`` ranks, ranked: those that fit ``device_memory``
    fastest first, then the others, each with its reason.

    ``module`` is a LightningModule (not yet configured: ``configure_model`` runs on copies that hold no storage) or
    a factory returning an ``nn.Module`` (then ``loss_fn(outputs, targets)``; pipelining needs a LightningModule
    that declares its trunk). ``global_batch`` samples of ``seq_len`` tokens make one optimizer step over all
    data-parallel ranks; or, as a Lightning dataloader gives them, ``rank_batch`` samples per data-parallel rank
    (give one of the two): every layout then takes ``rank_batch × dp`` samples a step, and the layouts are ranked by
    time per sample, not per step. ``machine`` is a :class:`~lightning_par3d.planning.machine.Machine` (e.g. from
    :func:`~lightning_par3d.planning.calibrate.calibrate`) or a profile name (:data:`~lightning_par3d.planning.
    machine.PROFILES`), which also gives ``devices_per_node`` and ``device_memory`` where they are None.
    ``device_memory`` is bytes or a size such as ``"80GiB"``. ``fixed`` pins sizes or settings (``{"tp": 2}``);
    ``search`` lists what is tried; ``base`` holds the settings that are not searched (``tp_plan``,
    ``split_points``, ``fsdp_blocks``, ``ac_every``, ...). ``optimizer`` names the optimizer's state layout as
    :func:`~lightning_par3d.estimate_memory` does. ``accumulate=True`` (with ``global_batch``): a layout may
    take the global batch as ``accumulate_grad_batches`` batches of ``global_batch / (dp × accumulate)`` samples on
    each data-parallel rank; each layout gets the fewest accumulated batches whose per-rank batch fits.

    Raises ``ValueError`` for input no plan can use (naming the value and the fix), and when no layout fits.
    Run it before launch: it simulates every rank in this process with torch's fake process group.
    """
    check_no_process_group("plan()")
    setup = _Setup.checked(
        world_size, devices_per_node, device_memory, _Batch.checked(global_batch, rank_batch, accumulate), seq_len,
        precision, machine, fixed, search, base, optimizer,
    )  # fmt: skip
    probes = _Probes(module, setup.base, seq_len, precision, loss_fn)
    memory = MemoryModel(module, world_size, seq_len, precision, optimizer, loss_fn, probes.params)
    notes = []
    with keep_excepthook(), collector_paused():
        space = setup.search
        if space.expert_parallel is None:
            experts, expert_note = expert_degrees(probes.root(), world_size)
            space = dataclasses.replace(space, expert_parallel=experts)
            notes += [expert_note] if expert_note else []
        later = space.context_parallel is None and "cp" not in setup.fixed  # searched where it may pay
        first = dataclasses.replace(space, context_parallel=(1,)) if later else space
        rows = _search(first, setup, probes, memory)
        if later:
            more, note = _context_rows(setup, probes, memory, rows, space)
            rows, notes = rows + more, [*notes, note]
    table = PlanTable(
        rows,
        world_size,
        setup.devices_per_node,
        setup.device_memory,
        setup.batch.describe(),
        seq_len,
        precision,
        setup.machine,
        model=_name(module),
        notes=[*notes, f"({memory.estimator_calls} estimator runs for {len(rows)} layouts.)"],
    )
    if not table.fitting:
        raise ValueError(_nothing_fits(table))
    return table


def _search(space: SearchSpace, setup: _Setup, probes: _Probes, memory: MemoryModel) -> list[PlanRow]:
    """The rows of every candidate of ``space``, each layout once."""
    rows = []
    seen: set[tuple[Any, ...]] = set()
    fits_plainly: set[Layout] = set()  # layouts that fit without activation checkpointing
    for config in candidates(setup.world_size, space, setup.fixed, setup.base):
        row = _evaluate(config, setup, probes, memory, fits_plainly)
        key = (row.layout, config.activation_checkpointing) if row.layout is not None else None
        if key is not None and key in seen:
            continue  # zero_stage=0 over dp_shard resolves to replication: already listed
        if key is not None:
            seen.add(key)
        rows.append(row)
    return rows


def _context_rows(
    setup: _Setup, probes: _Probes, memory: MemoryModel, rows: list[PlanRow], space: SearchSpace
) -> tuple[list[PlanRow], str]:
    """The context-parallel layouts' rows where activations dominate without them (:mod:`~lightning_par3d.
    planning.context_search`), and the table's note on why they were searched or not."""
    degrees = context_degrees(setup.world_size, setup.seq_len)
    if not degrees:
        return [], (
            f"(cp > 1 not searched: no degree that divides {setup.world_size} ranks has a 2·cp that divides "
            f"seq_len={setup.seq_len}.)"
        )
    why, why_not = context_may_pay(rows)
    if why is None:
        return [], (
            f"(cp > 1 not searched: {why_not}. SearchSpace(context_parallel=(1, 2)) or fixed={{'cp': 2}} searches "
            "it anyway.)"
        )
    refusal = context_refusal(probes.root(), setup.base)
    if refusal is not None:
        return [], f"(cp > 1 not searched although {why}: {refusal})"
    space = dataclasses.replace(space, context_parallel=degrees)
    return _search(space, setup, probes, memory), f"(cp = {', '.join(map(str, degrees))} searched too: {why}.)"


def evaluate(
    module: nn.Module | Callable[[], nn.Module],
    configs: Sequence[Par3DConfig],
    world_size: int,
    devices_per_node: int | None = None,
    device_memory: int | float | str | None = None,
    *,
    global_batch: int | None = None,
    seq_len: int,
    rank_batch: int | None = None,
    precision: str = "32-true",
    machine: Machine | str = DEFAULT_MACHINE,
    optimizer: str = "adamw",
    loss_fn: Callable[..., Tensor] | None = None,
) -> list[PlanRow]:
    """The rows of ``configs``, in their order, as :func:`plan` gives them (the memory and the predicted step, or
    why the layout cannot run): for a few layouts chosen by the caller (the bottleneck report's suggestions),
    without the search. The arguments are :func:`plan`'s."""
    check_no_process_group("evaluate()")
    setup = _Setup.checked(
        world_size, devices_per_node, device_memory, _Batch.checked(global_batch, rank_batch), seq_len, precision,
        machine, None, None, None, optimizer,
    )  # fmt: skip
    probes = _Probes(module, setup.base, seq_len, precision, loss_fn)
    memory = MemoryModel(module, world_size, seq_len, precision, optimizer, loss_fn, probes.params)
    with keep_excepthook(), collector_paused():
        return [_evaluate(config, setup, probes, memory, set()) for config in configs]


def choose_layout(
    module: nn.Module | Callable[[], nn.Module], world_size: int, *args: Any, **kwargs: Any
) -> Par3DConfig:
    """The fastest configuration that fits (``plan(...)``'s first row), as a ``Par3DConfig`` to train with; the
    arguments are :func:`plan`'s."""
    return plan(module, world_size, *args, **kwargs).best.config


# ---------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The batch of a step: ``global_batch`` over all data-parallel ranks, or ``rank_batch`` on each of them."""

    global_batch: int | None
    rank_batch: int | None
    accumulate: bool = False
    """The global batch may be taken as several accumulated batches per step."""

    @classmethod
    def checked(cls, global_batch: Any, rank_batch: Any, accumulate: bool = False) -> _Batch:
        if (global_batch is None) == (rank_batch is None):
            raise ValueError(
                f"Cannot plan: give the batch as global_batch (samples per step over every data-parallel rank) or "
                f"as rank_batch (samples per data-parallel rank, as a Lightning dataloader's batch_size), one of "
                f"the two; got global_batch={global_batch!r}, rank_batch={rank_batch!r}."
            )
        if accumulate and global_batch is None:
            raise ValueError("Cannot plan: accumulate=True takes the global batch (global_batch=...), not rank_batch.")
        return cls(global_batch, rank_batch, accumulate)

    def splits(self, layout: Layout) -> list[tuple[int, int]]:
        """The ``(samples per data-parallel rank, accumulated batches)`` this layout may take a step as, fewest
        accumulated batches first (the first alone without ``accumulate``); pipelined layouts keep per-rank batches
        their microbatches divide."""
        first = self.per_rank(layout)
        if first is None:
            return []
        if self.rank_batch is not None or not self.accumulate:
            return [(first, 1)]
        options = [(first // a, a) for a in range(1, first + 1) if first % a == 0]
        return [(b, a) for b, a in options if layout.pp == 1 or b % layout.microbatches == 0]

    def problems(self) -> list[str]:
        name, value = (
            ("global_batch", self.global_batch) if self.rank_batch is None else ("rank_batch", self.rank_batch)
        )
        return [] if _positive_int(value) else [f"{name}={value!r}: give a positive integer."]

    def per_rank(self, layout: Layout) -> int | None:
        """Samples per data-parallel rank at ``layout``; None where the global batch does not split over its dp."""
        if self.rank_batch is not None:
            return self.rank_batch
        assert self.global_batch is not None
        return self.global_batch // layout.dp if self.global_batch % layout.dp == 0 else None

    def describe(self) -> str:
        if self.rank_batch is not None:
            return f"{self.rank_batch} per data-parallel rank"
        return f"global batch {self.global_batch}"


@dataclasses.dataclass(frozen=True)
class _Setup:
    world_size: int
    devices_per_node: int
    device_memory: int
    batch: _Batch
    seq_len: int
    precision: str
    machine: Machine
    fixed: Mapping[str, Any]
    search: SearchSpace
    base: Par3DConfig
    optimizer: str

    @classmethod
    def checked(
        cls,
        world_size: Any,
        devices_per_node: Any,
        device_memory: Any,
        batch: _Batch,
        seq_len: Any,
        precision: str,
        machine: Machine | str,
        fixed: Mapping[str, Any] | None,
        search: SearchSpace | None,
        base: Par3DConfig | None,
        optimizer: str,
    ) -> _Setup:
        """The inputs, checked: every problem is named with its fix, together."""
        machine = machine_profile(machine) if isinstance(machine, str) else machine  # an unknown name raises
        devices_per_node = machine.devices_per_node if devices_per_node is None else devices_per_node
        device_memory = machine.device_memory if device_memory is None else device_memory
        problems = _world_problems(world_size, devices_per_node, machine.name)
        memory = _memory_bytes(device_memory, machine.name, problems)
        problems += batch.problems() + _run_problems(seq_len, precision, optimizer)
        if problems:
            raise ValueError("Cannot plan:\n" + "\n".join(f"  - {p}" for p in problems))
        base = base if base is not None else Par3DConfig()
        resolve_layout(base)  # its world-independent checks (plan styles, modes), with their messages
        fixed = dict(fixed or {})
        check_fixed(fixed, world_size)
        assert memory is not None
        return cls(
            world_size, devices_per_node, memory, batch, seq_len, precision, machine, fixed,
            search or SearchSpace(), base, optimizer,
        )  # fmt: skip


def _world_problems(world_size: Any, devices_per_node: Any, machine: str) -> list[str]:
    problems = []
    if not _positive_int(world_size):
        problems.append(f"world_size={world_size!r}: give the number of ranks to plan for, 1 or more.")
    if devices_per_node is None:
        problems.append(
            f"devices_per_node is not given and machine {machine!r} does not say it: give the devices per node (the "
            "ranks that share a node's fast links)."
        )
    elif not _positive_int(devices_per_node):
        problems.append(f"devices_per_node={devices_per_node!r}: give the devices per node, 1 or more.")
    elif _positive_int(world_size) and world_size > devices_per_node and world_size % devices_per_node:
        problems.append(
            f"world_size={world_size} is not a whole number of nodes of devices_per_node={devices_per_node}. Use a "
            f"multiple of {devices_per_node}, or the devices per node of your machine."
        )
    return problems


def _memory_bytes(device_memory: Any, machine: str, problems: list[str]) -> int | None:
    if device_memory is None:
        problems.append(f"device_memory is not given and machine {machine!r} does not say it: give it, e.g. '80GiB'.")
        return None
    try:
        memory = parse_bytes(device_memory)
    except ValueError as error:
        problems.append(str(error))
        return None
    if memory <= 0:
        problems.append(f"device_memory={device_memory!r}: give the memory of one device, more than 0.")
    return memory


def _run_problems(seq_len: Any, precision: str, optimizer: str) -> list[str]:
    from lightning_par3d.parallel.precision import PRECISIONS
    from lightning_par3d.zero.formula import OPTIMIZER_STATE_LAYOUTS

    problems = [] if _positive_int(seq_len) else [f"seq_len={seq_len!r}: give a positive integer."]
    if precision not in PRECISIONS:
        problems.append(f"precision={precision!r}: par3d trains with one of {', '.join(map(repr, PRECISIONS))}.")
    if optimizer not in OPTIMIZER_STATE_LAYOUTS:
        problems.append(f"optimizer={optimizer!r} is not known. Allowed: {', '.join(OPTIMIZER_STATE_LAYOUTS)}.")
    return problems


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _name(module: Any) -> str:
    return type(module).__name__ if isinstance(module, nn.Module) else getattr(module, "__name__", "model")


# ---------------------------------------------------------------- shared work


class _Probes:
    """The model's probes, each run once: work per pipeline split, shapes per split and tp, and their errors."""

    def __init__(
        self,
        module: nn.Module | Callable[[], nn.Module],
        base: Par3DConfig,
        seq_len: int,
        precision: str,
        loss_fn: Callable[..., Tensor] | None,
    ) -> None:
        self.module, self.base, self.seq_len, self.precision, self.loss_fn = module, base, seq_len, precision, loss_fn
        self._work: dict[tuple[int, int], list[StageWork] | str] = {}
        self._params: dict[tuple[int, int, int], list[StageParams] | str] = {}
        self._root: nn.Module | None = None
        self._by_depth: ProbedByDepth = {}  # the pipelined stages' work by role and depth, for every split

    def root(self) -> nn.Module:
        """The model, built once on the meta device (what the searches of cp and ep look at)."""
        if self._root is None:
            self._root = build_meta(self.module)
        return self._root

    def problem(self, layout: Layout) -> str | None:
        """Why the model cannot take this layout's stages and tp (par3d's own message), or None."""
        for found in (self._get_params(layout), self._get_work(layout)):
            if isinstance(found, str):
                return found
        return None

    def params(self, layout: Layout) -> list[StageParams]:
        found = self._get_params(layout)
        assert not isinstance(found, str), found
        return found

    def work(self, layout: Layout) -> list[StageWork]:
        found = self._get_work(layout)
        assert not isinstance(found, str), found
        return found

    def _get_params(self, layout: Layout) -> list[StageParams] | str:
        key = (layout.pp, layout.stages_per_rank, layout.tp)
        if key not in self._params:
            probe = probe_layout(layout.pp, layout.stages_per_rank, layout.tp)
            try:
                self._params[key] = stage_params(self.module, self.base, probe, self.precision)
            except (ValueError, TypeError) as error:
                self._params[key] = _model_message(error)
        return self._params[key]

    def _get_work(self, layout: Layout) -> list[StageWork] | str:
        key = (layout.pp, layout.stages_per_rank)
        if key not in self._work:
            probe = probe_layout(layout.pp, layout.stages_per_rank)
            try:
                self._work[key] = stage_work(self.module, self.base, probe, self.seq_len, self.loss_fn, self._by_depth)
            except (ValueError, TypeError) as error:
                self._work[key] = _model_message(error)
        return self._work[key]


def _model_message(error: Exception) -> str:
    """par3d's model checks in one line: the heading and the first problem, and how many more (one per block,
    typically, all alike)."""
    lines = [line.strip().removeprefix("- ") for line in str(error).splitlines() if line.strip()]
    if len(lines) > 3 and lines[0].endswith(":"):
        lines = [*lines[:2], f"(and {len(lines) - 2} more like it)"]
    return " ".join(lines)


def _evaluate(
    config: Par3DConfig, setup: _Setup, probes: _Probes, memory: MemoryModel, fits_plainly: set[Layout]
) -> PlanRow:
    from lightning_par3d.parallel.precision import check_precision

    layout, reason = rejection(config, setup.world_size, setup.devices_per_node, setup.batch.global_batch,
                               setup.batch.rank_batch, setup.seq_len)  # fmt: skip
    if reason is not None or layout is None:
        return PlanRow(config, layout, reason=reason)
    checkpointing = config.activation_checkpointing != "none"
    if checkpointing and setup.search.prune_checkpointing and layout in fits_plainly:
        return PlanRow(config, layout, reason=PRUNED)
    reason = probes.problem(layout)
    if reason is None:
        try:
            check_precision(setup.precision, layout.zero)
        except ValueError as error:
            reason = str(error)
    if reason is not None:
        return PlanRow(config, layout, reason=reason)
    row = _fitting_split(config, layout, setup, probes, memory)
    if row.fits and not checkpointing:
        fits_plainly.add(layout)
    return row


def _fitting_split(config: Par3DConfig, layout: Layout, setup: _Setup, probes: _Probes, memory: MemoryModel) -> PlanRow:
    """The layout's row at the first way of taking the batch (fewest accumulated batches) that fits, else at the
    first."""
    works = probes.work(layout)
    first_failure: PlanRow | None = None
    for rank_batch, accumulated in setup.batch.splits(layout):
        try:
            estimate = memory.estimate(config, layout, rank_batch, any(w.block_forward_flops for w in works))
        except (ValueError, TypeError) as error:
            return PlanRow(config, layout, reason=_model_message(error))
        time = accumulated_step(
            predict_step(
                config, layout, works, probes.params(layout), rank_batch, setup.machine,
                setup.devices_per_node, setup.precision, setup.optimizer,
            ),
            accumulated,
        )  # fmt: skip
        samples = rank_batch * layout.dp * accumulated
        if estimate.peak <= setup.device_memory:
            return PlanRow(config, layout, estimate, time, True, None, samples, rank_batch, accumulated)
        if first_failure is None:
            worst = max(estimate.rows, key=lambda row: row.total)
            why = (
                f"needs {format_bytes(estimate.peak)} on pipeline rank {worst.pp_rank} (state "
                f"{format_bytes(worst.state.total)}, activations {format_bytes(worst.activations + worst.recompute)}),"
                f" more than the {format_bytes(setup.device_memory)} of a device"
            )
            first_failure = PlanRow(config, layout, estimate, time, False, why, samples, rank_batch, accumulated)
    assert first_failure is not None  # rejection() refused a global batch that does not split
    return first_failure


def accumulated_step(time: StepTime, batches: int) -> StepTime:
    """A step of ``batches`` accumulated batches, each predicted as ``time``: every bucket ``batches`` times (the
    gradient reduction too, which par3d runs on the last batch only: a slight overestimate for accumulating
    layouts, which then win only where a larger per-rank batch does not fit)."""
    if batches == 1:
        return time
    return dataclasses.replace(
        time,
        compute=time.compute * batches,
        tp_comm=time.tp_comm * batches,
        dp_comm=time.dp_comm * batches,
        bubble=time.bubble * batches,
    )


def _nothing_fits(table: PlanTable) -> str:
    measured = [row for row in table.rows if row.memory is not None]
    if measured:
        smallest = min(measured, key=lambda row: row.memory.peak if row.memory else 0)
        assert smallest.memory is not None
        return (
            f"No layout of {table.model} on {table.world_size} ranks fits device_memory="
            f"{format_bytes(table.device_memory)}: the smallest, {smallest.describe()}, needs "
            f"{format_bytes(smallest.memory.peak)} per rank. Give more memory per device or more devices, a smaller "
            "batch or seq_len, or allow more of the search (fixed=..., search=SearchSpace(zero_stages=(3,), "
            "activation_checkpointing=('full',)))."
        )
    reasons: dict[str, int] = {}
    for row in table.rows:
        reasons[row.reason or "?"] = reasons.get(row.reason or "?", 0) + 1
    listed = "\n".join(f"  - {n}× {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:8])
    return f"No layout of {table.model} on {table.world_size} ranks can run:\n{listed}"
