"""The actions a pipeline rank runs in one step, in the order torch's own schedule runs them: the one walk over a
schedule that the memory estimator (microbatches in flight) and the planner (the step's timing,
:mod:`lightning_par3d.planning.schedule_timing`) both read.

:func:`pipeline_actions` builds the torch schedule a run builds (:func:`lightning_par3d.pipeline.runner.torch_schedule`)
over placeholder stages in a fake process group, and reads its ``pipeline_order``: per pipeline rank, the forward
(``F``), full backward (``B``), input-gradient (``I``) and weight-gradient (``W``) actions. :func:`schedule_peak`
walks one rank's actions for the activations it holds at once.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_par3d.config import Par3DConfig, resolve_layout
from lightning_par3d.distributed.fakeworld import fake_world

COMPUTE_KINDS = ("F", "B", "I", "W")
"""The action kinds that compute; torch's other kinds (gradient reduction, sends, unshard) are left out."""


@dataclass(frozen=True)
class Action:
    """One computation of a pipeline rank: ``kind`` (F, B, I or W) of ``microbatch`` on global stage ``stage``."""

    stage: int
    kind: str
    microbatch: int


@functools.cache
def pipeline_actions(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> dict[int, tuple[Action, ...]]:
    """Per pipeline rank, the compute actions of torch's schedule, in its order.

    Overlapped pairs (DualPipeV's ``OVERLAP_F_B``) are taken apart in their order. torch 2.13's ``Schedule1F1B``
    numbers the last rank's forwards 1…m instead of 0…m−1 in its ``pipeline_order`` (its step runs them right); a
    stage whose forwards (or input-gradient passes) do not number 0…m−1 is renumbered in its order, which is what
    its step runs.
    """
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from lightning_par3d.pipeline.runner import torch_schedule

    config = Par3DConfig(
        pp=pp, pipeline_schedule=schedule, virtual_stages=virtual_stages, microbatches=microbatches, dp_shard=1
    )
    layout = resolve_layout(config, pp)
    assert layout is not None
    with fake_world(pp):
        stages = [
            PipelineStage(nn.Identity(), i, layout.n_stages, torch.device("cpu")) for i in layout.stage_indices(0)
        ]
        order = torch_schedule(layout, stages, _no_loss).pipeline_order
    if order is None:
        raise RuntimeError(f"torch's schedule for {schedule!r} gives no pipeline_order to time.")
    return {rank: tuple(_renumbered(list(_compute_actions(actions)), microbatches)) for rank, actions in order.items()}


def _no_loss(outputs: Any, targets: Any) -> Any:
    return outputs


def _compute_actions(actions: Sequence[object]) -> Iterator[Action]:
    for action in flatten_actions(actions):
        kind = str(action.computation_type.value)
        if kind in COMPUTE_KINDS:
            yield Action(int(action.stage_index), kind, int(action.microbatch_index))


def _renumbered(actions: list[Action], microbatches: int) -> list[Action]:
    """Renumbers, per stage, the forwards (and the input-gradient passes, ``B`` and ``I`` together) in their order
    where their numbers are not 0…m−1."""
    families = {"F": "F", "B": "G", "I": "G"}
    by_family: dict[tuple[int, str], list[int]] = defaultdict(list)
    for i, action in enumerate(actions):
        if action.kind in families:
            by_family[(action.stage, families[action.kind])].append(i)
    fixed = list(actions)
    for positions in by_family.values():
        numbers = sorted(actions[i].microbatch for i in positions)
        if numbers != list(range(microbatches)):
            for k, i in enumerate(positions):
                fixed[i] = Action(actions[i].stage, actions[i].kind, k)
    return fixed


def schedule_peak(actions: Sequence[Action], per_microbatch: dict[int, int]) -> tuple[int, int]:
    """The estimator's walk over one rank's actions: a forward adds its stage's bytes, a full backward (or, in the
    zero-bubble schedules, the weight-gradient pass) releases them. Returns (peak bytes, peak count in flight)."""
    live = peak = count = peak_count = 0
    for action in actions:
        if action.kind == "F":
            live, count = live + per_microbatch[action.stage], count + 1
        elif action.kind in ("B", "W"):
            live, count = live - per_microbatch[action.stage], count - 1
        peak, peak_count = max(peak, live), max(peak_count, count)
    return peak, peak_count


def flatten_actions(actions: Sequence[Any]) -> Iterator[Any]:
    """The actions of a torch schedule's ``pipeline_order`` row, grouped actions opened up and idle slots left out."""
    for action in actions:
        if action is None:
            continue
        sub = getattr(action, "sub_actions", None)
        if sub:
            yield from flatten_actions(sub)
        else:
            yield action
