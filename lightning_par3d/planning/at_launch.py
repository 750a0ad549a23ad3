"""``layout="auto"``: the layout chosen at launch, on the job's own ranks, by the planner.

:func:`choose_at_launch` runs on every rank once the default process group exists and before any mesh:

1. the machine: every rank measures the job's devices and links at once (:func:`~lightning_par3d.planning.
   calibrate.calibrate_job`), or ``plan_machine`` names a profile;
2. rank 0 plans (:func:`~lightning_par3d.planning.plan`) in a fresh interpreter of its own: the planner simulates
   every rank over torch's fake process group, which cannot live beside the job's real one in this process;
3. rank 0 prints the top of the table and why it chose, and sends the choice (or the planner's error) to every
   rank, which raises the same error or trains with the same layout.

What is searched and what stays: the sizes and settings of :data:`~lightning_par3d.planning.candidates.FIXED_KEYS`
that the user set away from their defaults are pinned; the rest of the configuration (the plan, split points,
``init``, timeouts) is the user's, unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par3d.config import Par3DConfig, changed_settings
from lightning_par3d.distributed import faults
from lightning_par3d.distributed.agree import on_rank_zero_for_long
from lightning_par3d.planning.machine import Machine, format_bytes, machine_profile, parse_bytes

SHOWN = 5
"""Fitting layouts printed at launch (the whole table is ``lightning_par3d.plan``'s)."""
RESERVE = 12
"""Fitting layouts beyond those measured that rank 0 sends with them, fastest predicted first: what the factors
learned from the measured ones may re-rank."""


@dataclasses.dataclass(frozen=True)
class BatchSplit:
    """How the chosen layout takes the global batch: ``rank_batch`` samples per data-parallel rank, ``accumulate``
    batches per optimizer step."""

    global_batch: int
    rank_batch: int
    accumulate: int = 1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A layout the planner put on top: the configuration to train with, how it takes the global batch, its
    predicted step and its name in the table."""

    config: Par3DConfig
    split: BatchSplit
    predicted_s: float
    name: str
    buckets: tuple[float, ...] = ()
    """The predicted step's buckets (:func:`~lightning_par3d.planning.learn.buckets_of`)."""
    reserve: bool = False
    """Not one of those to measure: a layout measured only where the measured ones show the model wrong about it
    (:func:`~lightning_par3d.planning.learn.worth_measuring`)."""


MEASURED_BY_DEFAULT = 3
"""``measure=None``: how many of the fastest predicted layouts ``layout="auto"`` measures where it can."""


def measure_count(config: Par3DConfig) -> int:
    """How many candidates to measure: ``config.measure``, or :data:`MEASURED_BY_DEFAULT`."""
    return MEASURED_BY_DEFAULT if config.measure is None else int(config.measure)


def global_batch_of(config: Par3DConfig, rank_batch: int, world_size: int, accumulate: int = 1) -> int:
    """The global batch ``layout="auto"`` keeps: ``config.global_batch``, else the loader's ``rank_batch`` × the
    data-parallel size the configuration names without ``"auto"`` (``dp``, else the world ÷ the pinned tp × pp × cp) ×
    ``accumulate`` (the Trainer's ``accumulate_grad_batches``)."""
    if config.global_batch is not None:
        return int(config.global_batch)
    return rank_batch * default_dp(config, world_size) * accumulate


def default_dp(config: Par3DConfig, world_size: int) -> int:
    """The data-parallel size the configuration names without ``layout="auto"``."""
    if config.dp is not None:
        return int(config.dp)
    pinned = fixed_settings(config)
    model_ranks = int(pinned.get("tp", 1)) * int(pinned.get("pp", 1)) * int(pinned.get("cp", 1))
    return max(world_size // model_ranks, 1)


def fixed_settings(config: Par3DConfig) -> dict[str, Any]:
    """The sizes and settings the user pinned: those the planner may search that differ from their defaults."""
    from lightning_par3d.planning.candidates import FIXED_KEYS

    settings = {name: getattr(config, name) for name in FIXED_KEYS}
    return {name: settings[name] for name in changed_settings(settings)}


def check_before_launch(config: Par3DConfig, world_size: int) -> None:
    """The checks of a ``layout="auto"`` configuration that need no process: the pinned sizes against the world
    size, the profile's name, the memory's form. Raises ``ValueError`` naming the value and the fix."""
    from lightning_par3d.planning.candidates import check_fixed

    check_fixed(fixed_settings(config), world_size)
    pinned = fixed_settings(config)
    dp = config.dp or (
        int(pinned["dp_replicate"]) * int(pinned["dp_shard"]) if {"dp_replicate", "dp_shard"} <= set(pinned) else None
    )
    if config.global_batch is not None and dp is not None and config.global_batch % dp:
        lower = config.global_batch - config.global_batch % dp
        nearest = " or ".join(str(b) for b in (lower, lower + dp) if b > 0)
        raise ValueError(
            f"global_batch={config.global_batch} does not split over the dp={dp} data-parallel ranks the sizes set "
            f"here fix, so no layout can keep it. The nearest that do: {nearest}."
        )
    if config.plan_machine is not None:
        machine_profile(config.plan_machine)
    if config.plan_device_memory is not None:
        parse_bytes(config.plan_device_memory)


def batch_shape(config: Par3DConfig, loader: Any, where: str) -> tuple[int, int]:
    """``(samples per data-parallel rank, tokens per sample)`` of a training batch: ``config.plan_batch`` if given,
    else a ``DataLoader``'s ``batch_size`` and the last dimension of its dataset's first sample (its first tensor,
    in a tuple, list or dict). ``where`` names the loader's source in the error raised when neither tells."""
    if config.plan_batch is not None:
        rank_batch, seq_len = config.plan_batch
        return int(rank_batch), int(seq_len)
    size: Any = getattr(loader, "batch_size", None)
    dataset = getattr(loader, "dataset", None)
    sample = _first_tensor(dataset[0]) if size and dataset is not None and hasattr(dataset, "__getitem__") else None
    if sample is None or sample.dim() == 0 or not isinstance(size, int):
        raise ValueError(
            f"layout='auto' needs the shape of a training batch to plan, and {where} does not tell it (a DataLoader "
            f"with a batch_size over a dataset whose samples hold a tensor; got {type(loader).__name__}). Give it: "
            "plan_batch=[samples per data-parallel rank, sequence length]."
        )
    return int(size), int(sample.shape[-1])


def _first_tensor(sample: Any) -> torch.Tensor | None:
    if isinstance(sample, torch.Tensor):
        return sample
    values = sample.values() if isinstance(sample, dict) else sample if isinstance(sample, (list, tuple)) else ()
    return next((found for v in values if (found := _first_tensor(v)) is not None), None)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device: what the planner builds from,
    without a second copy of real weights (the module may hold them, on rank 0)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def surrogate_loss(outputs: Any, *targets: Any) -> torch.Tensor:
    """What the planner runs a plain model's backward from, when it has no loss function of its own (Fabric and
    Accelerate take one per step): cross-entropy of the outputs' logits against integer targets of their shape
    (a language model's loss, whose log-softmax the memory estimate must count), else the outputs' mean."""
    logits = getattr(outputs, "logits", outputs)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    target = targets[0] if targets else None
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.shape == logits.shape[:-1]:
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten().to(logits.device))
    return logits.float().mean()


def device_memory(device: torch.device, local_ranks: int) -> int:
    """A device's memory: a GPU's total, or on CPUs the machine's memory shared by its ``local_ranks``."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical // max(local_ranks, 1))


def choose_at_launch(
    config: Par3DConfig,
    module: nn.Module | None,
    *,
    world_size: int,
    devices_per_node: int,
    rank_batch: int,
    seq_len: int,
    precision: str,
    device: torch.device,
    measure: Callable[[], Machine],
    accumulate: int | None = None,
    count: int = 1,
) -> list[Candidate]:
    """The configurations to train with, fastest predicted first: ``config`` with each of the ``count`` layouts the
    planner found fastest (see the module docstring; fewer where fewer fit, unless ``config.measure`` asked for
    more: an error), then, where ``count`` > 1, up to :data:`RESERVE` other fitting layouts (``reserve``), and how
    each takes the global batch (:func:`global_batch_of`, from the loader's
    ``rank_batch``). ``accumulate``: the Trainer's ``accumulate_grad_batches``, which the chosen layout may change
    (None: a front-end whose loop accumulates as the user writes it; the layout then takes the global batch as one
    batch per data-parallel rank). Every rank calls it; ``module`` (the LightningModule before
    ``configure_model``, or a factory) is needed on rank 0 only; ``measure()`` measures the job's machine on every
    rank at once. Raises the planner's ``ValueError`` on every rank where no layout can run."""
    machine = config.plan_machine if config.plan_machine is not None else measure()
    memory = config.plan_device_memory or device_memory(device, devices_per_node)
    batch = global_batch_of(config, rank_batch, world_size, accumulate or 1)
    limit = plan_time_limit(config)
    outcome, value = on_rank_zero_for_long(  # the plan may outlast timeout_s: the others wait on the store
        lambda: _plan_on_rank_zero(
            config, module, world_size, devices_per_node, memory, (batch, accumulate is not None), seq_len, precision,
            machine, count, limit,
        ),
        faults.run_key(f"plan{next(_PLANS)}"),
        limit + 60,
    )  # fmt: skip
    if outcome == "error":
        raise ValueError(value)
    return [
        candidate_from(config, arguments, BatchSplit(batch, *split), predicted, name, buckets, reserve)
        for arguments, split, predicted, name, buckets, reserve in value
    ]


_PLANS = itertools.count()
"""This process's plans at launch: each one's key in the job's store is its own (every rank counts alike)."""


def plan_time_limit(config: Par3DConfig) -> float:
    """How long rank 0's plan may take (its fresh interpreter is stopped after): ``timeout_s`` less 30 s, and a
    minute at least, since planning a large model takes a while whatever the collectives' timeout."""
    return max(60.0, config.timeout_s - 30)


def candidate_from(
    config: Par3DConfig,
    arguments: dict[str, Any],
    split: BatchSplit,
    predicted_s: float,
    name: str,
    buckets: tuple[float, ...] = (),
    reserve: bool = False,
) -> Candidate:
    """``config`` with the layout ``arguments`` (:meth:`PlanRow.strategy_arguments
    <lightning_par3d.planning.table.PlanRow.strategy_arguments>`) in place of ``layout="auto"``."""
    cleared: dict[str, Any] = dict(
        layout=None, plan_machine=None, plan_device_memory=None, plan_batch=None, global_batch=None, dp=None,
        measure=None,
    )  # fmt: skip
    return Candidate(dataclasses.replace(config, **cleared, **arguments), split, predicted_s, name, buckets, reserve)


def layout_arguments(config: Par3DConfig) -> dict[str, Any]:
    """The settings of ``config`` a plan chooses (sizes, ZeRO stage, schedule, microbatches, virtual stages,
    checkpointing), as :func:`candidate_from` takes them back."""
    from lightning_par3d.planning.candidates import FIXED_KEYS

    return {name: getattr(config, name) for name in FIXED_KEYS if name != "dp"}


def _plan_on_rank_zero(
    config: Par3DConfig,
    module: Any,
    world_size: int,
    devices_per_node: int,
    memory: int | str,
    batch: tuple[int, bool],
    seq_len: int,
    precision: str,
    machine: Machine | str,
    count: int,
    limit_s: float,
) -> tuple[str, Any]:
    """``("ok", [(sizes and settings, (samples per data-parallel rank, accumulated batches), predicted step, name,
    its buckets, reserve) for each of the ``count`` to measure, then the reserve])`` or ``("error", the message)``,
    after printing the choice. ``batch``: the
    global batch, and whether a layout may accumulate it."""
    from lightning_par3d.planning.planner import plan
    from lightning_par3d.utils.fresh_interpreter import call

    if module is None:
        return "error", "layout='auto': rank 0 has no copy of the model to plan with (an integration error)."
    base = dataclasses.replace(
        config, layout=None, plan_machine=None, plan_device_memory=None, plan_batch=None, global_batch=None,
        measure=None,
    )  # fmt: skip
    loss_fn = None if callable(getattr(module, "training_step", None)) else surrogate_loss
    global_batch, accumulate = batch
    try:
        table = call(
            plan, module, world_size, devices_per_node, memory, global_batch=global_batch, accumulate=accumulate,
            seq_len=seq_len, precision=precision, machine=machine, fixed=fixed_settings(config), base=base,
            loss_fn=loss_fn, what="the layout plan (layout='auto')", timeout_s=limit_s,
        )  # fmt: skip
    except (ValueError, TypeError, RuntimeError) as error:
        return (
            "error",
            f"layout='auto' found no layout to train with: {error}{_nearest(config, world_size, global_batch)}",
        )
    fitting = table.fitting
    if config.measure is not None and config.measure > len(fitting):
        return "error", (
            f"layout='auto' with measure={config.measure}, but only {len(fitting)} layouts fit: give measure "
            f"{len(fitting)} or fewer (0: train the predicted fastest without measuring)."
        )
    print(describe_choice(table), flush=True)
    from lightning_par3d.planning.learn import buckets_of

    measured = table.to_measure(max(count, 1))
    reserve = [row for row in fitting if all(row is not m for m in measured)][:RESERVE] if count > 1 else []
    chosen = []
    for index, row in enumerate(measured + reserve):
        assert row.rank_batch is not None and row.time is not None
        split = (row.rank_batch, row.accumulate)
        entry = (row.strategy_arguments(), split, row.time.total, row.describe(), buckets_of(row.time))
        chosen.append((*entry, index >= len(measured)))
    return "ok", chosen


def _nearest(config: Par3DConfig, world_size: int, global_batch: int) -> str:
    """The global batches nearest ``global_batch`` that the configuration's data-parallel size splits, where it does
    not split this one."""
    dp = default_dp(config, world_size)
    if global_batch % dp == 0:
        return ""
    lower = global_batch - global_batch % dp
    nearest = [b for b in (lower, lower + dp) if b > 0]
    return (
        f" The global batch of {global_batch} does not split over the {dp} data-parallel ranks of the sizes set; the "
        f"nearest that do: {' or '.join(map(str, nearest))} (global_batch=...)."
    )


def describe_choice(table: Any) -> str:
    """What rank 0 prints: the choice and why, and the top of the table."""
    best = table.best
    fitting = table.fitting
    reason = f"the fastest predicted per sample of the {len(fitting)} layouts that fit"
    if len(fitting) > 1:
        second = fitting[1]
        per_sample = [row.time.total / (row.samples or 1) for row in (best, second)]
        reason += f"; the next, {second.describe()}, is {per_sample[1] / per_sample[0] - 1:+.0%} per sample"
    assert best.time is not None and best.memory is not None
    split = ""
    if best.rank_batch is not None and best.layout is not None:
        split = (
            f" It takes the global batch of {best.samples} samples as batch_size {best.rank_batch} per data-parallel "
            f"rank × dp={best.layout.dp}"
            + (f" × accumulate_grad_batches={best.accumulate}" if best.accumulate > 1 else "")
            + "."
        )
    head = (
        f"par3d layout='auto': chose {best.describe()} on {table.world_size} ranks: {reason}.{split} Predicted step "
        f"{best.time.total * 1e3:,.1f} ms ({best.samples_per_s:,.1f} samples/s), {format_bytes(best.memory.peak)} "
        f"per rank of {format_bytes(table.device_memory)}."
    )
    rows = table.to_markdown(top=SHOWN).split("\n\nRejected layouts")[0]
    pinned = "Par3DStrategy(" + ", ".join(f"{k}={v!r}" for k, v in best.strategy_arguments().items()) + ")"
    context = "".join(f"\n{note}" for note in table.notes if note.startswith("(cp"))  # searched or not, and why
    return f"{head}\n{rows}{context}\nTo pin this layout: {pinned}"
