"""The bottleneck report's advice: each change it might suggest, with the step it predicts, from what the run
measured, through the planner's cost model.

The run measured its step on every rank, split into buckets (:mod:`lightning_par3d.callbacks.bottleneck.analysis`):
compute (forward, backward, optimizer), tensor-parallel collectives, data-parallel collectives, the pipeline's
send/recv and idle time, and the rest (dataloader wait, Lightning's loop, par3d's own measuring). The cost model
(:mod:`lightning_par3d.planning.cost`) predicts the same buckets for any layout, from the model's FLOPs and ops, its
collectives, torch's schedule order, and the machine's figures, measured on the job's own ranks at the end of fit
(:func:`~lightning_par3d.planning.calibrate.calibrate_job`).

A change is predicted in three moves:

1. the current layout is predicted, bucket by bucket, averaged over its pipeline ranks as the measurement is;
2. each bucket's **correction** is measured / predicted (1 where the model predicts none of it): what the model
   misses on this machine, for this model (the per-op costs of DTensor, the gloo transport, ...). The pipeline's
   waiting is the stages' compute seen from another rank, so it takes the compute's correction; what the run
   measured in the pipeline bucket beyond that is a cost of each schedule action (torch's per-action work, the
   send/recv calls around it), spread over the rank's actions. (This is the run's own figure for what the
   calibration's ``pipeline_action_s`` estimates from a do-nothing pipeline, so the advice predicts without the
   latter: counting both would count the actions twice). The zero-bubble schedules' split of each backward
   into ``I`` and ``W`` (Python walking the autograd graph, priced by the calibration's own measurement of it,
   ``split_backward_op_s``) is not aten ops, so it takes no correction: on the demo the compute's correction is
   about 3×, and applying it there predicted ``zbv_zero_bubble`` 55 % slower where it measured 10 % faster;
3. the change is predicted with the same model, each bucket times its correction, plus that cost per action of its
   schedule, the rest (dataloader, loop) as measured; the slowest pipeline rank's sum is the step, scaled so that
   the current layout's comes out as measured.

So "raise microbatches" is predicted from its real price: twice the microbatches is twice the ops and collectives
of half the size, whose fixed costs the cost model counts; the bubble it saves is what the schedule's own order
says. A change is **suggested** only where it fits in memory and is predicted faster by more than the run's noise
(the spread of the sampled steps, 5 % at least); where none is, the report says so, with what each would cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_par3d.config import Layout, Par3DConfig, resolve_layout
from lightning_par3d.planning.cost import BUCKETS
from lightning_par3d.planning.machine import Machine

MIN_GAIN = 0.05
"""The least predicted gain (a share of the step) that a suggestion needs, whatever the measured noise."""


@dataclasses.dataclass(frozen=True)
class Measured:
    """The run's step, in seconds, averaged over its ranks: the cost model's buckets, the rest, and the noise."""

    step: float
    compute: float
    tp_comm: float
    dp_comm: float
    bubble: float
    other: float
    """Dataloader wait, Lightning's loop and par3d's own measuring: no layout changes them."""
    dataloader: float
    """The dataloader's wait, within :attr:`other`."""
    noise: float
    """The relative spread of the sampled steps ((slowest − fastest) / mean)."""

    def bucket(self, name: str) -> float:
        return float(getattr(self, name))


@dataclasses.dataclass(frozen=True)
class Change:
    """A change of the configuration that the report may suggest."""

    bucket: str
    """The report's bucket it addresses (``pipeline``, ``tp_comm``, ``dp_comm``, ``optimizer``, ``dataloader``)."""
    description: str
    settings: dict[str, Any]
    """The ``Par3DConfig`` fields it sets (empty for a change outside the layout)."""
    removes: str | None = None
    """For a change outside the layout (more dataloader workers): the measured bucket it would take away, at
    best."""


@dataclasses.dataclass(frozen=True)
class Advice:
    """A change and the step predicted with it."""

    change: Change
    predicted_s: float | None
    """The predicted step (None where the change cannot run: see :attr:`reason`)."""
    measured_s: float
    """The run's measured step."""
    suggested: bool
    reason: str | None = None
    """Why it cannot run (a configuration or memory check), when it cannot."""

    @property
    def gain(self) -> float | None:
        """The predicted share of the step saved (negative: slower)."""
        return None if self.predicted_s is None else 1 - self.predicted_s / self.measured_s

    def line(self) -> str:
        """``"microbatches=8: step 1,280 → ~2,130 ms (+66 %)"``."""
        if self.predicted_s is None:
            return f"{self.change.description}: cannot run here ({self.reason})"
        bound = "≥ " if self.change.removes else "~"
        change = -(self.gain or 0.0)
        return (
            f"{self.change.description}: step {self.measured_s * 1e3:,.0f} → {bound}{self.predicted_s * 1e3:,.0f} ms "
            f"({change:+.0%})"
        )


# ---------------------------------------------------------------- the changes worth predicting


def candidate_changes(config: Par3DConfig, layout: Layout, rank_batch: int, num_workers: int | None) -> list[Change]:
    """The changes the report weighs for a run at ``layout``: a change for each bucket a layout setting can shrink,
    each valid for the layout's sizes (the memory is checked when predicted)."""
    changes = _pipeline_changes(config, layout, rank_batch) if layout.pp > 1 else []
    if layout.tp > 1:
        changes.append(
            Change("tp_comm", f"tp={layout.tp // 2} (dp_shard={layout.dp_shard * 2})",
                   dict(tp=layout.tp // 2, dp_shard=layout.dp_shard * 2, dp_replicate=layout.dp_replicate))
        )  # fmt: skip
    changes += _data_parallel_changes(layout)
    if config.activation_checkpointing != "none":
        changes.append(Change("compute", "activation_checkpointing=none", dict(activation_checkpointing="none")))
    if num_workers is not None:
        changes.append(
            Change("dataloader", f"num_workers={max(2, 2 * num_workers)}", {}, removes="dataloader")
        )  # fmt: skip
    return changes


def _pipeline_changes(config: Par3DConfig, layout: Layout, rank_batch: int) -> list[Change]:
    m, schedule = layout.microbatches, layout.schedule
    changes = []
    for more in (2 * m, m // 2):
        if more >= 1 and more != m and rank_batch % more == 0:
            changes.append(Change("pipeline", f"microbatches={more}", dict(microbatches=more)))
    for other, virtual in (("1f1b", 1), ("interleaved_1f1b", 2), ("zbv_zero_bubble", 2), ("gpipe", 1)):
        if other != schedule:
            name = f"pipeline_schedule={other}" + (f", virtual_stages={virtual}" if virtual > 1 else "")
            changes.append(Change("pipeline", name, dict(pipeline_schedule=other, virtual_stages=virtual)))
    return changes


def _data_parallel_changes(layout: Layout) -> list[Change]:
    if layout.dp == 1:
        return []
    changes = []
    if layout.dp_shard > 1:
        for stage in (1, 2, 3) if layout.cp == 1 else ():  # under cp, FSDP2 (stage 3) alone
            if stage != layout.zero and not (stage == 2 and layout.pp > 1):
                changes.append(Change("dp_comm", f"zero_stage={stage}", dict(zero_stage=stage)))
        if layout.dp_replicate == 1 and layout.dp_shard % 2 == 0 and layout.dp_shard >= 4 and layout.zero == 3:
            # HSDP shards over dp_shard // 2 ranks; with dp_shard=2 nothing would be left to shard over
            replicas = dict(dp_replicate=2, dp_shard=layout.dp_shard // 2)
            changes.append(Change("dp_comm", "dp_replicate=2 (HSDP)", replicas))
    elif layout.tp == 1 and layout.pp == 1 and layout.cp == 1:
        changes.append(Change("dp_comm", "dp_shard with zero_stage=1", dict(dp_shard=layout.dp, dp_replicate=1,
                                                                           zero_stage=1)))  # fmt: skip
    return changes


def configs_of(config: Par3DConfig, layout: Layout, changes: Sequence[Change]) -> list[Par3DConfig]:
    """The current layout's configuration (first), then each change's (the current one for a change outside the
    layout)."""
    now = dataclasses.replace(
        config, pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp, dp=None,
        zero_stage=layout.zero, layout=None,
    )  # fmt: skip
    return [now, *(dataclasses.replace(now, **change.settings) for change in changes)]


# ---------------------------------------------------------------- predicting


def mean_buckets(time: Any) -> dict[str, float]:
    """A predicted step's buckets averaged over its pipeline ranks (as the measured ones are over the ranks)."""
    ranks = time.pp_ranks or ((time.compute, time.tp_comm, time.dp_comm, time.bubble),)
    return {name: sum(rank[i] for rank in ranks) / len(ranks) for i, name in enumerate(BUCKETS)}


def corrections(measured: Measured, time: Any) -> dict[str, float]:
    """Per bucket, measured / predicted (1 where the model predicts none of it: nothing to learn from); the
    bubble's waiting takes the compute's correction, and ``"action"`` is the measured pipeline time beyond it per
    schedule action (see the module docstring)."""
    predicted = mean_buckets(time)
    step = max(sum(predicted.values()), 1e-12)
    split = sum(time.split) / len(time.split) if time.split else 0.0  # see corrected_step
    observed = {name: measured.bucket(name) for name in predicted}
    predicted["compute"], observed["compute"] = predicted["compute"] - split, max(observed["compute"] - split, 0.0)
    factors = {name: observed[name] / value if value > 0.01 * step else 1.0 for name, value in predicted.items()}
    factors["bubble"] = factors["compute"]
    actions = sum(time.actions) / len(time.actions) if time.actions else 0.0
    waiting = predicted["bubble"] * factors["bubble"]
    factors["action"] = max(measured.bubble - waiting, 0.0) / actions if actions else 0.0
    return factors


def corrected_step(time: Any, factors: dict[str, float], other: float) -> float:
    """The slowest pipeline rank's step with each bucket corrected and each schedule action's cost, plus what no
    layout changes. The zero-bubble split's work (``time.split``) is the calibration's own measurement of that
    Python work, not aten ops: it keeps its figure rather than the compute's correction."""
    ranks = time.pp_ranks or ((time.compute, time.tp_comm, time.dp_comm, time.bubble),)
    actions = time.actions or (0,) * len(ranks)
    splits = time.split or (0.0,) * len(ranks)
    per_rank = [
        sum(rank[i] * factors[name] for i, name in enumerate(BUCKETS))
        + factors["action"] * count
        - (factors["compute"] - 1) * split
        for rank, count, split in zip(ranks, actions, splits, strict=True)
    ]
    return max(per_rank) + other


def judge(measured: Measured, changes: Sequence[Change], rows: Sequence[Any], current: Any) -> list[Advice]:
    """Each change's advice from the planner's rows (``current``: the current layout's row; ``rows``: each change's,
    in order), slowest suggestions last. A change is suggested where it can run and is predicted faster than the
    measured step by more than the noise (:data:`MIN_GAIN` at least)."""
    factors = corrections(measured, current.time)
    scale = measured.step / corrected_step(current.time, factors, measured.other)
    threshold = max(MIN_GAIN, measured.noise)
    advice = []
    for change, row in zip(changes, rows, strict=True):
        if change.removes is not None:
            predicted: float | None = measured.step - measured.bucket(change.removes)
            reason = None
        elif row.fits and row.time is not None:
            predicted = scale * corrected_step(row.time, factors, measured.other)
            reason = None
        else:
            predicted, reason = None, row.reason or "no prediction"
        suggested = predicted is not None and predicted < measured.step * (1 - threshold)
        advice.append(Advice(change, predicted, measured.step, suggested, reason))
    return sorted(advice, key=lambda a: (not a.suggested, a.predicted_s if a.predicted_s is not None else 1e30))


def advise(
    module: nn.Module | Callable[[], nn.Module],
    config: Par3DConfig,
    world_size: int,
    devices_per_node: int,
    device_memory: int | str,
    measured: Measured,
    *,
    rank_batch: int,
    seq_len: int,
    precision: str,
    machine: Any,
    num_workers: int | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
) -> list[Advice]:
    """Every change the report weighs for this run, with its predicted step (see the module docstring). Run it in
    a process without a process group (the planner simulates the ranks over torch's fake one): the report runs it
    in a fresh interpreter on rank 0."""
    from lightning_par3d.planning.planner import evaluate

    layout = resolve_layout(config, world_size)
    assert layout is not None
    changes = candidate_changes(config, layout, rank_batch, num_workers)
    if isinstance(machine, Machine):  # the run measured its own cost per action (see the module docstring)
        machine = dataclasses.replace(machine, pipeline_action_s=0.0)
    rows = evaluate(
        module, configs_of(config, layout, changes), world_size, devices_per_node, device_memory,
        rank_batch=rank_batch, seq_len=seq_len, precision=precision, machine=machine, loss_fn=loss_fn,
    )  # fmt: skip
    current = rows[0]
    if current.time is None:
        raise ValueError(f"the planner cannot predict the run's own layout ({current.reason})")
    return judge(measured, changes, rows[1:], current)
